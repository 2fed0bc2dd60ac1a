"""Torch compatibility: which releases, which private names, and how the engine replaces them.

:mod:`.torch_release` says which torch releases are supported; :mod:`.torch_private` is
the one table of every private torch name the engine reads or replaces, with its release
window (:mod:`.private_name` is one entry of it, :mod:`.torch_private_compiled` the
names of compiled models); :mod:`.torch_replacing` is the one mechanism that replaces a
torch attribute at run time and puts it back.
"""

__all__: list[str] = []
