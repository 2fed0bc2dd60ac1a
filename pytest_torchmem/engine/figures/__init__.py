"""Figures: what the engine reports and the facts it reads them with. No module here imports torch.

:mod:`.report` is the result, :class:`~.report.MemoryReport`; :mod:`.timeline` the
storage timeline of one step and the peaks read from it; :mod:`.units` parses and
formats byte sizes; :mod:`.stopped` is the error a stopped trace raises, with its partial
report; :mod:`.gpu_profiles` holds the GPUs the fake ``cuda`` device models;
:mod:`.modelled_device` the device a step request names (its kind, the profile it follows).
"""

__all__: list[str] = []
