"""``python -m pytest_torchmem``: the command line of :mod:`pytest_torchmem.cli.main`."""

import sys

from pytest_torchmem.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
