"""pytest hooks of pytest-torchmem (filled in by the plugin issue)."""
