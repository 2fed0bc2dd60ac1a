"""The command line: `python -m pytest_torchmem show/diff/...` over saved results and snapshot files.

:mod:`.main` parses the command; :mod:`.saved` reads saved results back; :mod:`.diffing`
compares two of them; :mod:`.listing` prints entries and diffs; :mod:`.fitting` is
``fit``, ``rank`` and ``ranks``.
"""
