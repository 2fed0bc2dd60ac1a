"""The command line: `python -m pytest_torchmem show/diff/...` over saved results and snapshot files."""
