"""The pytest plugin: an entry point (hooks.py) and the objects each run registers, one job each."""
