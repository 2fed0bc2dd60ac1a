"""Read the installed torch's own C++ constants: from the headers a wheel ships, and
from the compiled code of its libraries.

The fake cuda device follows constants of torch's C++ sources (``kMinBlockSize``,
the cuBLAS workspace sizes, the attention backends' thresholds, ...). A test pins
each against the running torch, so that the release suite, run in each supported
release's venv (PyPI's CUDA wheels), fails on the release that changes one:

* :func:`header_constant` reads ``constexpr`` values and initialisers from
  ``torch/include`` (CPU and CUDA wheels both ship the headers);
* :func:`disassembly` gives the x86-64 code of the functions of a library under
  ``torch/lib`` whose (mangled) name matches, read with binutils' ``readelf`` and
  ``objdump`` as docs/explanation/torch-releases.md describes; :func:`immediates`
  the constants that code loads or compares with. ``libc10.so`` and
  ``libtorch_cpu.so`` are in every build, ``libc10_cuda.so`` and
  ``libtorch_cuda.so`` only in CUDA builds: :func:`cuda_library` skips a test
  on a CPU build.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

__all__ = [
    "cuda_library",
    "cudnn_header_text",
    "disassembly",
    "has_function",
    "header_constant",
    "header_text",
    "immediates",
    "instructions",
    "library",
    "wheel_requirement",
]

TORCH_DIR = Path(torch.__file__).resolve().parent


def header_text(relative: str) -> str:
    """The text of ``torch/include/<relative>`` of the installed torch."""
    path = TORCH_DIR / "include" / relative
    if not path.is_file():
        raise AssertionError(f"torch {torch.__version__} ships no {relative} under {path.parent}")
    return path.read_text()


def header_constant(relative: str, name: str) -> int:
    """The integer value a header gives ``name``: ``constexpr T name = V;``,
    ``static constexpr T name = V;``, a member initialiser ``T name{V};``, or a
    ``#define name V``."""
    text = header_text(relative)
    patterns = (
        rf"constexpr\s+[\w:<>\s]+?\b{re.escape(name)}\s*=\s*([0-9][0-9a-fA-FxX']*)[uUlL]*\s*;",
        rf"\b{re.escape(name)}\s*\{{\s*([0-9][0-9a-fA-FxX']*)[uUlL]*\s*\}}",
        rf"#define\s+{re.escape(name)}\s+\(?([0-9][0-9a-fA-FxX']*)[uUlL]*\)?",
    )
    for pattern in patterns:
        found = re.findall(pattern, text)
        if found:
            values = {int(value.replace("'", ""), 0) for value in found}
            assert len(values) == 1, f"{name} has several values in {relative}: {sorted(values)}"
            return values.pop()
    raise AssertionError(f"no constant {name} in torch/include/{relative} of torch {torch.__version__}")


def library(name: str) -> Path:
    """``torch/lib/<name>`` of the installed torch (it must exist)."""
    path = TORCH_DIR / "lib" / name
    if not path.is_file():
        raise AssertionError(f"torch {torch.__version__} has no {name} in {path.parent}")
    return path


def cuda_library(name: str) -> Path:
    """``torch/lib/<name>`` of a CUDA build; the test is skipped on a CPU build, which
    has no CUDA libraries (the release venvs are CUDA builds: they check it)."""
    if torch.version.cuda is None:
        pytest.skip(f"a CPU build of torch has no {name}: the CUDA builds of each release check it")
    return library(name)


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise AssertionError(
            f"reading torch's compiled constants needs binutils' {name} (apt-get install binutils)"
        )
    return found


@functools.cache
def _functions(path: Path) -> tuple[tuple[str, int, int], ...]:
    """``(mangled name, address, size)`` of every defined function symbol of ``path``."""
    out = subprocess.run(
        [_tool("readelf"), "-Ws", "--wide", str(path)], capture_output=True, text=True, check=True
    ).stdout
    seen: dict[tuple[str, int], int] = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 8 or fields[3] != "FUNC" or fields[6] == "UND":
            continue
        address, size = int(fields[1], 16), int(fields[2], 0)
        if address and size:
            seen[(fields[7].split("@")[0], address)] = size
    return tuple((name, address, size) for (name, address), size in seen.items())


def has_function(path: Path, symbol: str) -> bool:
    """Whether ``path`` defines a function whose mangled name matches ``symbol``."""
    return any(re.search(symbol, name) for name, _, _ in _functions(path))


@functools.cache
def disassembly(path: Path, symbol: str) -> str:
    """The code of every function of ``path`` whose mangled name matches the regular
    expression ``symbol`` (``.cold`` parts included), one ``objdump -d`` listing after
    another; at least one must match."""
    matched = sorted({(address, size) for name, address, size in _functions(path) if re.search(symbol, name)})
    if not matched:
        raise AssertionError(f"no function matching {symbol!r} in {path} (torch {torch.__version__})")
    listings = []
    for address, size in matched:
        listings.append(
            subprocess.run(
                [
                    _tool("objdump"), "-d", "--no-show-raw-insn", f"--start-address={address:#x}",
                    f"--stop-address={address + size:#x}", str(path),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    return "\n".join(listings)


def immediates(code: str) -> set[int]:
    """The immediate operands (``$0x...``) of the instructions of ``code``, as
    unsigned 64-bit numbers."""
    return {int(value, 16) for value in re.findall(r"\$0x([0-9a-f]+)", code)}


def instructions(code: str) -> str:
    """``code``'s instructions without their addresses, ``; ``-separated, spaces collapsed
    (for regular expressions over a few consecutive instructions)."""
    lines = [line.split("\t", 2)[-1] for line in code.splitlines() if re.match(r"\s+[0-9a-f]+:\t", line)]
    return "; ".join(" ".join(line.split()) for line in lines)


def wheel_requirement(distribution: str) -> str | None:
    """The version the installed torch wheel pins (``==``) for the distribution whose
    name matches the regular expression ``distribution``, or None when it pins none
    (a CPU wheel names no nvidia package)."""
    from importlib.metadata import requires

    for requirement in requires("torch") or ():
        match = re.match(rf"(?:{distribution})\s*==\s*([0-9][\w.]*)", requirement)
        if match:
            return match.group(1)
    return None


def cudnn_header_text() -> str:
    """The C headers of the cuDNN a CUDA wheel installs (``nvidia/cudnn/include``), joined;
    the test is skipped on a CPU build."""
    if torch.version.cuda is None:
        pytest.skip("a CPU build of torch installs no cuDNN: the CUDA builds of each release check it")
    include = TORCH_DIR.parent / "nvidia" / "cudnn" / "include"
    headers = sorted(include.glob("cudnn*.h"))
    if not headers:
        raise AssertionError(f"no cuDNN headers in {include} beside torch {torch.__version__}")
    return "\n".join(path.read_text() for path in headers)
