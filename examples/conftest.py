"""The example suites' one piece of setup: torchvision beside a CPU build of torch.

torchvision's wheels on PyPI are built for the CUDA build of torch; beside the
CPU wheel this repository installs (``torch==2.13.0``), their C++ extension does
not load and ``import torchvision`` fails (pytorch/vision#9085), and with it
every library that imports it: transformers' models, Lightning (through
torchmetrics). The suites here need none of torchvision's operators, so
``tests/torchvision_import.py`` imports it without them, as the project's own
tests do. With a torchvision built for your torch this does nothing.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from torchvision_import import import_torchvision  # noqa: E402

import_torchvision()
sys.path.pop(0)
