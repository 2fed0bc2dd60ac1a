"""The pytest plugin: an entry point (hooks.py) and the objects each run registers, one job each.

- Entry and options: :mod:`.hooks` (pytest's entry point), :mod:`.hookspecs`,
  :mod:`.settings` (options and their ini twins), :mod:`.markers` (``memory_budget``),
  :mod:`.fixture` (the ``torchmem`` object).
- A check: :mod:`.checking` traces, judges and records it; :mod:`.estimating` is its
  figures on one device; :mod:`.judging` its verdict, :mod:`.messages` the verdict's
  words, :mod:`.outcomes` how it reaches pytest; :mod:`.headroom`, :mod:`.fitting`,
  :mod:`.advising`, :mod:`.leaking` for GPUs' room, ``fit``, advice and leaks.
- Snapshots: :mod:`.snapshots` (files), :mod:`.places` (where), :mod:`.releases` (per
  torch release), :mod:`.writing` (the update, written once), :mod:`.unwritten`,
  :mod:`.ledger` (entries no test used).
- The run's end: :mod:`.record`, :mod:`.relay` (pytest-xdist), :mod:`.reporting` and
  :mod:`.summary`; :mod:`.exports` (the HTML report, timelines for PyTorch's memory viewer).
"""
