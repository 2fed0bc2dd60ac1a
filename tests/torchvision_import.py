"""Import torchvision beside the CPU build of torch.

torchvision's wheels on PyPI (0.28.0 pairs with torch 2.13.0) are built against
the CUDA build of torch: beside the CPU wheel this project tests with, their C++
extension (``torchvision/_C.so``, linked to ``libtorch_cuda.so`` and
``libc10_cuda.so``) does not load, and torchvision's
``_meta_registrations`` module then fails at import, registering a fake kernel
for an operator the extension would have defined::

    RuntimeError: operator torchvision::nms does not exist

(pytorch/vision#9085). With a torchvision built for the CPU torch the first
import below succeeds as is and nothing is stubbed.
Worse, transformers imports torchvision whenever it is installed, and every
transformers model class (``GPT2LMHeadModel``, ...) then fails with
``ModuleNotFoundError``. The model definitions themselves are plain Python; only
the detection operators (``nms``, ``roi_align``, ...) need the extension, and no
classification model calls them. So :func:`import_torchvision` imports
torchvision, and when that fails for this reason only, puts an empty module in
place of ``torchvision._meta_registrations`` and imports it again. It has to run
before anything else imports torchvision (transformers included):
``tests/conftest.py`` calls it when pytest loads it, ``benchmarks/speed.py``
before it imports transformers.
"""

from __future__ import annotations

import re
import sys
import types

_MISSING_OPERATOR = re.compile(r"operator torchvision::\w+ does not exist")
_META_REGISTRATIONS = "torchvision._meta_registrations"


def import_torchvision() -> types.ModuleType | None:
    """torchvision, imported (see the module's docstring); None when it is not installed."""
    try:
        import torchvision
    except ModuleNotFoundError as error:
        if error.name == "torchvision":
            return None
        raise
    except RuntimeError as error:
        if not _MISSING_OPERATOR.search(str(error)):
            raise
        # The failed import took torchvision and _meta_registrations back out of
        # sys.modules; the submodules it had finished (extension, ...) stay and
        # are reused.
        stub = types.ModuleType(
            _META_REGISTRATIONS,
            "Stand-in: torchvision's C++ extension did not load beside this torch "
            "(tests/torchvision_import.py), so its operators have no kernels to fake.",
        )
        sys.modules[_META_REGISTRATIONS] = stub
        import torchvision
    return torchvision
