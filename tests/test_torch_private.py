"""The one table of private torch names (``engine/torch_compat/torch_private.py``), held to the running torch.

Three guards, run on every release of the window (``.ci/torch-venv``):

- every entry resolves exactly where its ``since``/``until`` (and ``cuda_only``)
  say, and fails to resolve elsewhere, so the table's windows stay honest;
- ``private``/``replacing`` refuse a name missing from the table, explain a name
  missing from torch in one line, and always put a replaced attribute back;
- no module of the package names a private torch name outside the table (an AST
  scan).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import pytest_torchmem
from pytest_torchmem.engine.torch_compat import torch_private
from pytest_torchmem.engine.torch_compat.torch_private import (
    PRIVATE,
    Private,
    TorchPrivateError,
    present,
    private,
    private_name,
)
from pytest_torchmem.engine.torch_compat.torch_release import installed_release, supported_range
from pytest_torchmem.engine.torch_compat.torch_replacing import appending, replacing

PACKAGE = Path(pytest_torchmem.__file__).parent
RELEASE = installed_release()[:2]
CUDA_BUILD = torch.version.cuda is not None


# -- (a) every entry, on the running torch ---------------------------------------------


@pytest.mark.parametrize("path", sorted(PRIVATE))
def test_every_entry_resolves_exactly_where_its_releases_say(path: str) -> None:
    """Guards since/until: an entry that resolves outside its window (the window
    is too narrow) or fails inside it (torch moved the name) fails here."""
    found = PRIVATE[path]
    expected = found.expected(RELEASE, cuda_build=CUDA_BUILD)
    if expected:
        private(path)  # raises TorchPrivateError with the reason
    else:
        with pytest.raises(TorchPrivateError):
            torch_private._resolved.pop(path, None)
            private(path)
    assert present(path) is expected, (
        f"{path}: expected {'present' if expected else 'absent'} in torch {torch.__version__} "
        f"(since={found.since}, until={found.until}, cuda_only={found.cuda_only})"
    )


@pytest.mark.parametrize("path", sorted(PRIVATE))
def test_every_entry_says_why_and_names_its_releases_within_the_window(path: str) -> None:
    found = PRIVATE[path]
    assert path.startswith("torch.") and found.path == path
    assert found.why.strip() and "\n" not in found.why
    first, last = torch_private.window()
    for bound in (found.since, found.until):
        assert bound is None or first <= bound <= last, f"{path}: {bound} outside the window"
    if found.since is not None and found.until is not None:
        assert found.since <= found.until


def test_replaced_entries_are_attributes_of_an_importable_owner() -> None:
    for path, found in PRIVATE.items():
        if found.replaced and found.expected(RELEASE, cuda_build=CUDA_BUILD):
            owner_path, _, name = path.rpartition(".")
            assert hasattr(torch_private._resolve(owner_path), name), path


def test_expected_follows_since_until_and_the_build() -> None:
    entry = Private("torch._x", "a test", since=(2, 12), until=(2, 14))
    assert [entry.expected((2, minor)) for minor in range(10, 16)] == [False, False, True, True, True, False]
    cuda = Private("torch._y", "a test", cuda_only=True)
    assert cuda.expected((2, 13), cuda_build=True)
    assert not cuda.expected((2, 13), cuda_build=False)


# -- (b) private, replacing ---------------------------------------------------------------


def test_a_path_not_in_the_table_is_refused_with_a_key_error_naming_it() -> None:
    with pytest.raises(KeyError, match=r"torch\._C\._not_tabled is not in .*PRIVATE"):
        private("torch._C._not_tabled")
    with pytest.raises(KeyError, match="torch._C._not_tabled"):
        with replacing("torch._C._not_tabled", None):
            pass
    with pytest.raises(KeyError, match="torch._C._not_tabled"):
        private_name("torch._C._not_tabled")


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch) -> str:
    """A tabled name no torch has (from 2.12 on, replaced at run time)."""
    path = "torch._C._torchmem_never_there"
    monkeypatch.setitem(PRIVATE, path, Private(path, "a test of a missing name", since=(2, 12), replaced=True))
    return path


def test_a_missing_path_raises_one_line_naming_the_path_and_the_windows(missing: str) -> None:
    with pytest.raises(TorchPrivateError) as raised:
        private(missing)
    message = str(raised.value)
    assert "\n" not in message
    assert missing in message
    assert "a test of a missing name" in message
    assert "expected in torch 2.12 on" in message
    assert f"supports torch {supported_range()}" in message
    assert torch.__version__ in message
    assert not present(missing)
    with pytest.raises(TorchPrivateError, match="_torchmem_never_there"):
        with replacing(missing, None):
            pass


def test_a_missing_module_raises_the_same_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    path = "torch._torchmem_no_such_module.name"
    monkeypatch.setitem(PRIVATE, path, Private(path, "a test", until=(2, 11)))
    with pytest.raises(TorchPrivateError, match=r"no torch\._torchmem_no_such_module\.name .*2\.10 to 2\.11"):
        private(path)


@pytest.fixture
def replaceable(monkeypatch: pytest.MonkeyPatch) -> str:
    """A tabled, replaced attribute of a module of torch (the RNG state getter)."""
    assert PRIVATE["torch.random.get_rng_state"].replaced
    return "torch.random.get_rng_state"


def test_replacing_restores_the_original_on_normal_exit(replaceable: str) -> None:
    original = torch.random.get_rng_state
    stand_in = object()
    with replacing(replaceable, stand_in) as found:
        assert found is original
        assert torch.random.get_rng_state is stand_in
    assert torch.random.get_rng_state is original
    assert "get_rng_state" in vars(torch.random)


def test_replacing_restores_the_original_on_an_exception(replaceable: str) -> None:
    original = torch.random.get_rng_state
    with pytest.raises(ZeroDivisionError):
        with replacing(replaceable, object()):
            1 / 0  # noqa: B018
    assert torch.random.get_rng_state is original


def test_nested_replacements_unwind_to_the_original(replaceable: str) -> None:
    original = torch.random.get_rng_state
    first, second = object(), object()
    with replacing(replaceable, first):
        with replacing(replaceable, second) as found:
            assert found is first
        assert torch.random.get_rng_state is first
    assert torch.random.get_rng_state is original


def test_replacing_an_inherited_attribute_leaves_none_of_its_own() -> None:
    """An attribute the owner inherits (a class's base has it) is deleted again,
    not pinned on the owner."""

    class Base:
        def method(self) -> str:
            return "base"

    class Owner(Base):
        pass

    import types

    module = types.ModuleType("torch._torchmem_test_owner")
    module.Owner = Owner  # type: ignore[attr-defined]
    path = "torch._torchmem_test_owner.Owner.method"
    import sys

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, module.__name__, module)
        patch.setitem(PRIVATE, path, Private(path, "a test", replaced=True))
        with replacing(path, lambda self: "replaced"):
            assert Owner().method() == "replaced"
        assert "method" not in vars(Owner)
        assert Owner().method() == "base"


def test_replacing_refuses_an_entry_not_marked_replaced() -> None:
    path = next(path for path, found in PRIVATE.items() if not found.replaced)
    with pytest.raises(ValueError, match="replaced=True"):
        with replacing(path, None):
            pass


def test_appending_adds_to_the_same_list_and_takes_out_that_item_however_the_block_ends() -> None:
    """The foreach type list keeps its identity (modules that bound it, DTensor's
    ``append`` at import, see the item); the item goes, an equal one stays."""
    import torch.utils._foreach_utils as foreach_utils

    path = "torch.utils._foreach_utils._foreach_supported_types"
    listed = foreach_utils._foreach_supported_types
    before = list(listed)

    class Equal:
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Equal)

        __hash__ = object.__hash__

    mine, theirs = Equal(), Equal()
    with appending(path, mine):
        assert foreach_utils._foreach_supported_types is listed and listed[-1] is mine
        listed.append(theirs)  # a module imported in the block adds its own
    assert listed == [*before, theirs] and listed[-1] is theirs
    listed.remove(theirs)
    with pytest.raises(ZeroDivisionError):
        with appending(path, mine):
            1 / 0  # noqa: B018
    assert listed == before


def test_appending_refuses_what_is_not_a_replaced_list() -> None:
    path = next(path for path, found in PRIVATE.items() if not found.replaced)
    with pytest.raises(ValueError, match="replaced=True"):
        with appending(path, None):
            pass
    with pytest.raises(TypeError, match="torch.random.get_rng_state is a function, not a list"):
        with appending("torch.random.get_rng_state", None):
            pass


def test_private_name_is_the_attribute_once_present() -> None:
    assert private_name("torch.nn.Module._compiled_call_impl") == "_compiled_call_impl"


# -- (c) no private torch name outside the table ---------------------------------------

THE_TABLE = "engine/torch_compat/torch_private.py"


def _is_private(parts: list[str]) -> bool:
    """A ``_``-prefixed component, dunders (``__version__``) aside."""
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__")) for part in parts)


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` (None unless rooted at a plain name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every private torch name ``source`` reads: an import
    of a torch module path with a ``_`` component or of a ``_`` name, and an
    attribute chain with a ``_`` component rooted at ``torch`` or at a name an
    import bound to a torch path (``import torch.utils.checkpoint as checkpoint``),
    operators aside (see :data:`_OPS`)."""
    tree = ast.parse(source)
    bound = {"torch": "torch"}
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    if _is_private(alias.name.split(".")):
                        found.add((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "torch":
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    bound[alias.asname or alias.name] = name
                    if _is_private(name.split(".")):
                        found.add((node.lineno, name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = _chain(node)
            if parts and parts[0] in bound:
                name = ".".join([bound[parts[0]], *parts[1:]])
                if _is_private(name.split(".")) and not name.startswith(_OPS):
                    found.add((node.lineno, name))
    return sorted(found)


#: Operators (``torch.ops.aten._softmax.default``, ``torch.ops._c10d_functional``) are
#: names in the dispatcher's registry, not Python attributes of torch: a rule of an
#: op only some releases have is registered through ``private_op`` (None elsewhere).
_OPS = "torch.ops."


def _names_by_module() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = private_torch_names(path.read_text(encoding="utf-8"))
        if names:
            found[path.relative_to(PACKAGE).as_posix()] = names
    return found


def test_no_module_names_a_private_torch_name_outside_the_table() -> None:
    """Every private torch name is read through engine/torch_compat/torch_private.py (private(), or
    replaced through engine/torch_compat/torch_replacing.py), where it is written down with why and
    in which releases."""
    strays = {
        module: names
        for module, names in _names_by_module().items()
        if module != THE_TABLE
    }
    assert not strays, "private torch names outside engine/torch_compat/torch_private.py:\n" + "\n".join(
        f"  pytest_torchmem/{module}:{line}: {name}" for module, names in strays.items() for line, name in names
    )


def test_the_scan_sees_every_spelling() -> None:
    source = """
import torch
import torch._C
import torch.utils._pytree as pytree
import torch.utils.checkpoint as checkpoint
from torch import _C
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _python_dispatch
from torch import nn

torch._C._get_dispatch_mode
checkpoint._recomputation_hook
nn.Module._compiled_call_impl
torch.__version__
torch.nn.functional.relu
torch.ops.aten._softmax.default
"""
    names = {name for _, name in private_torch_names(source)}
    assert names == {
        "torch._C",
        "torch._C._get_dispatch_mode",
        "torch.utils._pytree",
        "torch._subclasses.fake_tensor.FakeTensor",
        "torch.utils._python_dispatch",
        "torch.utils.checkpoint._recomputation_hook",
        "torch.nn.Module._compiled_call_impl",
    }
