import sys
from pathlib import Path

# The model zoo (tests/zoo.py) is shared by the test suite and the benchmarks.
sys.path.insert(0, str(Path(__file__).parent))
