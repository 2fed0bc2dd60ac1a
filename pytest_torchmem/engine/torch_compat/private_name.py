"""One private torch name as the engine's table holds it: its path, why it is used, which releases have it.

The table itself is :data:`pytest_torchmem.engine.torch_compat.torch_private.PRIVATE` (the compiled
models' part: :mod:`pytest_torchmem.engine.torch_compat.torch_private_compiled`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Private", "Release", "table"]

#: A torch minor release, (major, minor).
Release = tuple[int, int]


@dataclass(frozen=True)
class Private:
    """One private torch name: its dotted ``path``, ``why`` the engine uses it,
    the releases that have it as used (``since``/``until``, both included;
    None: the whole window), whether the engine replaces it at run time, and
    whether only CUDA builds of torch have it (``cuda_only``: a binding that a
    CPU-only build does not compile).

    Of a replaced name: ``thread_scoped``, only the thread that replaced it (the
    tracing thread) gets the replacement's answers, every other thread the
    original's; ``by_reader``, a module's global that only the readers the
    replacement accepts read replaced (the traced program's code), the module's
    own code and every other reader the original; ``added``, torch has no such
    attribute in any release of the window, and the replacement adds it for its
    block."""

    path: str
    why: str
    since: Release | None = None
    until: Release | None = None
    replaced: bool = False
    cuda_only: bool = False
    thread_scoped: bool = False
    by_reader: bool = False
    added: bool = False

    def expected(self, release: Release, cuda_build: bool | None = None) -> bool:
        """Whether torch ``release`` (major, minor) has this name as used; ``cuda_build``:
        whether that torch is a CUDA build (None: as the running torch is)."""
        if self.added:
            return False  # (the engine adds it; no release has it)
        if self.cuda_only:
            if cuda_build is None:
                import torch

                cuda_build = torch.version.cuda is not None
            if not cuda_build:
                return False
        return (self.since is None or release >= self.since) and (
            self.until is None or release <= self.until
        )


def table(*entries: Private) -> dict[str, Private]:
    """The entries by path (a path given twice is an error)."""
    table: dict[str, Private] = {}
    for entry in entries:
        if entry.path in table:
            raise ValueError(f"{entry.path} is in the table twice")
        table[entry.path] = entry
    return table
