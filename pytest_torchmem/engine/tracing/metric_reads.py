"""The values libraries read only to report them: a trainer's logged loss, read as a number.

``.item()`` of a tensor whose value the trace does not know is given a stand-in
value, and the estimate lists it (the program could have taken another path
on the real value). Some reads cannot change the step's memory: the number
goes into a trainer's metrics and logs, nowhere else. :data:`METRIC_READS`
names them, by the library's file and function; :func:`metric_read` says
whether the op being traced is one, and such a read is not listed (its
stand-in is 0). ``tests/test_frameworks.py`` checks that each site exists in
the installed library and reads a value there.
"""

from __future__ import annotations

import os
import sys
from typing import Final

import torch

__all__ = ["METRIC_READS", "metric_read"]

#: (the library file's path, as it ends; the function) -> what the value read is.
METRIC_READS: Final = {
    (os.path.join("transformers", "trainer.py"), "_finalize_training"): (
        "Trainer.train()'s mean training loss, for the metrics it returns and logs"
    ),
    (os.path.join("transformers", "trainer.py"), "_maybe_log_save_evaluate"): (
        "the training loss Trainer logs every logging_steps"
    ),
}

_OURS: Final = (
    os.path.dirname(os.path.abspath(torch.__file__)),
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
)


def metric_read() -> bool:
    """Whether the innermost frame outside torch and this package is a read of
    :data:`METRIC_READS`."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_OURS):
            return any(
                filename.endswith(path) and frame.f_code.co_name == function for path, function in METRIC_READS
            )
        frame = frame.f_back
    return False
