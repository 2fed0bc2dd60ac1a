"""Fit: the largest size whose step fits, and what to change when it does not.

:mod:`.search` finds the largest size that fits a budget or a GPU, and ranks GPUs;
:mod:`.advice` suggests changes, each one an estimate.
"""

__all__: list[str] = []
