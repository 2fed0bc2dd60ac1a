"""Every run-time replacement of a torch attribute is an entry of the table, and torch is as before after.

The engine replaces torch attributes while it traces (the GPU view, inductor's
device queries, the RNG state copies, FSDP2's storage calls, ...), always through
one mechanism (``engine/torch_compat/torch_replacing.py``: ``replacing``, ``appending``,
``replacing_item``), each path an entry of the table marked ``replaced``. These
tests take a picture of torch (every callable, class, module and container a
torch module or a torch class holds, by identity) before an estimate, at points
inside it (each phase of the step, inductor's compile, its output modules'
loading) and after it:

- inside, everything that differs from before is a path the mechanism has in
  effect at that moment: nothing is replaced by hand, around the table;
- every path the mechanism had in effect is a table entry marked ``replaced``;
- after, torch is exactly as before, and nothing is in effect, also when the
  model's forward raised.

A hand-made replacement (``setattr(torch.x, ...)`` and a ``finally`` that puts it
back) fails the first check: it differs inside and is in nobody's effect.
"""

from __future__ import annotations

import ast
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import pytest
import torch
from torch import nn

import pytest_torchmem
import pytest_torchmem as tm
from pytest_torchmem.engine.torch_compat import torch_private, torch_replacing
from pytest_torchmem.engine.torch_compat.torch_private import PRIVATE
from pytest_torchmem.engine.torch_compat.torch_replacing import in_effect
from pytest_torchmem.engine.tracing import compiled_program, inductor_device
from pytest_torchmem.engine.tracing.compiled_cuda import CudaProgram
from pytest_torchmem.engine.tracing.tracker import Tracker
from following import follows_compiled

class Picture(dict[str, Any]):
    """Torch's attributes by dotted path, each the object itself (held, so that its id
    stays its own); :attr:`owners`: the modules and classes looked at."""

    owners: set[str]

#: The replacements torch makes itself while the engine compiles (not the engine's).
_TORCHS_OWN: Final = {
    # convert_frame.py (_compile / transform): while dynamo compiles a frame
    "torch.fx.graph_module._forward_from_src",
}


def _behaviour(value: Any) -> bool:
    """Whether a picture holds ``value``: what the engine replaces is behaviour (functions,
    descriptors, classes, modules). torch's modules also keep state among their globals,
    which it changes as it runs (flags, caches, dynamo's global state per compile): the
    tabled containers the engine adds to are looked at by :func:`_tabled` instead."""
    return callable(value) or isinstance(value, (property, classmethod, staticmethod, types.ModuleType))


def _torch_modules() -> list[Any]:
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and (name == "torch" or name.startswith("torch."))
    ]


def picture() -> Picture:
    """Every non-data attribute of torch's modules and of the classes they define, by its
    dotted path (a class's attributes under the class's own module and name)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (deprecated objects warn when looked at)
        return _picture()


def _picture() -> Picture:
    found = Picture()
    found.owners = set()
    classes: dict[int, type] = {}
    for module in _torch_modules():
        found.owners.add(module.__name__)
        for name, value in list(vars(module).items()):
            # (dunders, and the globals dynamo installs for its compiled code: __compiled_fn_1)
            if name.startswith("__") or not _behaviour(value):
                continue
            found[f"{module.__name__}.{name}"] = value
            if isinstance(value, type) and str(getattr(value, "__module__", "")).startswith("torch"):
                classes[id(value)] = value
    for cls in classes.values():
        owner = f"{cls.__module__}.{cls.__qualname__}"
        found.owners.add(owner)
        for name, value in list(vars(cls).items()):
            if name.startswith("__") or not _behaviour(value):
                continue
            found[f"{owner}.{name}"] = value
    return found


def changed(before: Picture, now: Picture) -> set[str]:
    """The paths whose object differs, or that one picture has and the other lacks, torch's
    own replacements aside. What a module imported since holds, and a module that
    appears imported (a package gains its submodule), are not changes."""
    differ = {path for path, value in before.items() if path in now and now[path] is not value}
    gone = set(before) - set(now)
    added = {
        path
        for path in set(now) - set(before)
        if path.rpartition(".")[0] in before.owners
        and not (isinstance(now[path], types.ModuleType) and sys.modules.get(now[path].__name__) is now[path])
    }
    return (differ | gone | added) - _TORCHS_OWN


#: A dict the table lets the engine set keys of that torch fills as it runs (a cache).
_CACHES: Final = ("torch.ops.aten.add.Tensor._dispatch_cache",)


def _tabled() -> dict[str, Any]:
    """What every replaced entry of the table is on this torch: the object (held), for a
    list or a dict the ids of its items too (torch's caches aside), for an added one
    whether it is there."""
    found: dict[str, Any] = {}
    for path, entry in PRIVATE.items():
        if not entry.replaced:
            continue
        if entry.added:
            owner, _, name = path.rpartition(".")
            found[path] = hasattr(torch_private._resolve(owner), name)
            continue
        if not torch_private.present(path):
            continue
        owner_path, _, name = path.rpartition(".")
        owner = torch_private._resolve(owner_path)
        # (a class's own descriptor as it is: a classmethod's binding is new at each lookup)
        value = vars(owner)[name] if isinstance(owner, type) and name in vars(owner) else getattr(owner, name)
        if isinstance(value, list):
            found[path] = (value, [id(v) for v in value])
        elif isinstance(value, dict) and path not in _CACHES:
            found[path] = (value, {k: id(v) for k, v in value.items()})
        else:
            found[path] = value
    return found


def _same(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The tabled paths whose object (or items) differ after."""

    def key(value: Any) -> Any:
        if isinstance(value, tuple):
            return (id(value[0]), value[1])
        return value if isinstance(value, bool) else id(value)

    return sorted(path for path in before.keys() | after.keys() if key(before.get(path)) != key(after.get(path)))


class Watch:
    """Pictures of torch at points inside an estimate, each with what the mechanism had in
    effect then (one picture per distinct set in effect: the points repeat)."""

    def __init__(self, before: Picture) -> None:
        self.before = before
        self.seen: dict[tuple[str, ...], set[str]] = {}

    def look(self) -> None:
        effect = in_effect()
        if effect not in self.seen:
            self.seen[effect] = changed(self.before, picture())

    @property
    def replaced(self) -> set[str]:
        return {path for effect in self.seen for path in effect}

    def outside_the_mechanism(self) -> dict[tuple[str, ...], set[str]]:
        return {effect: paths - set(effect) for effect, paths in self.seen.items() if paths - set(effect)}


@contextmanager
def watching(monkeypatch: pytest.MonkeyPatch, before: Picture) -> Iterator[Watch]:
    """Look at torch at each phase of the step, when our inductor backend compiles a graph,
    inside the cuda program's inner compile and when an output module is loaded."""
    watch = Watch(before)

    def looking(real: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            watch.look()
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(Tracker, "set_phase", looking(Tracker.set_phase))
    monkeypatch.setattr(compiled_program._FakeInductor, "__call__", looking(compiled_program._FakeInductor.__call__))
    monkeypatch.setattr(CudaProgram, "_inner", looking(CudaProgram._inner))
    monkeypatch.setattr(compiled_program, "remember", looking(compiled_program.remember))
    monkeypatch.setattr(inductor_device, "remember", looking(inductor_device.remember))
    yield watch


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class _Checkpointed(nn.Module):
    """A checkpointed block (the RNG state copies and the routed recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def _fsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _eager(device: str) -> None:
    tm.estimate(_Checkpointed(), torch.randn(8, 16), device=device, optimizer=_adamw)


def _compiled(device: str) -> None:
    tm.estimate(torch.compile(_mlp()), torch.randn(8, 16), device=device, optimizer=_adamw)


def _step_function(device: str) -> None:
    model = _mlp()
    tm.estimate(_step, (model, torch.randn(8, 16), _adamw(model.parameters())), device=device)


def _parallel(device: str) -> None:
    tm.estimate(
        _mlp(), torch.randn(8, 16), device=device, optimizer=_adamw, parallel=tm.Parallel({"dp": 2}, _fsdp)
    )


#: Paths each case must have replaced (the pictures inside it were taken where they are).
_EXPECTED: dict[tuple[str, str], set[str]] = {
    ("eager", "cpu"): {"torch.get_rng_state", "torch.utils.checkpoint._recomputation_hook"},
    ("eager", "cuda"): {"torch.cuda.is_available", "torch._subclasses.fake_tensor.FakeTensor.device"},
    ("compiled", "cpu"): {"torch._inductor.config.force_disable_caches", "torch._inductor.config.cpp.simdlen"},
    ("compiled", "cuda"): {
        "torch._inductor.config.force_disable_caches",
        "torch._dynamo.device_interface.device_interfaces",
        "torch.cuda.get_device_properties",
        "torch.ops.aten.add.Tensor._dispatch_cache",
    },
    ("step function", "cpu"): {"torch.autograd.backward"},
    ("step function", "cuda"): {"torch.autograd.backward", "torch.cuda.is_available"},
    ("parallel", "cpu"): {"torch.distributed.fsdp._fully_shard._fsdp_param.free_storage"},
    ("parallel", "cuda"): {"torch.meta", "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage"},
}
_CASES = {"eager": _eager, "compiled": _compiled, "step function": _step_function, "parallel": _parallel}


def _before(case: Callable[[str], None], device: str) -> tuple[dict[str, Any], Picture]:
    """The tabled names and the picture before, once torch has imported and set up what the
    table names and the case needs (its lazy imports and one-time set-ups, dynamo's
    registry of device interfaces say, are not the engine's changes)."""
    _tabled()  # resolving the table imports what it names
    case(device)
    return _tabled(), picture()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "case",
    [
        "eager",
        pytest.param("compiled", marks=follows_compiled),
        "step function",
        "parallel",
    ],
)
def test_every_replacement_is_a_table_entry_and_torch_is_as_before(
    case: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _CASES[case]
    tabled, before = _before(run, device)
    with watching(monkeypatch, before) as watch:
        run(device)
    assert watch.seen, "no picture was taken inside the estimate"
    assert watch.outside_the_mechanism() == {}, "replaced outside torch_replacing's mechanism"
    assert _EXPECTED[case, device] <= watch.replaced
    for path in watch.replaced:
        assert PRIVATE[path].replaced, path
    monkeypatch.undo()
    assert in_effect() == ()
    assert changed(before, picture()) == set()
    assert _same(tabled, _tabled()) == []


class _Raises(nn.Module):
    """Fails in its forward, once the step's replacements are all in effect."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if h.is_cuda:
            assert torch.cuda.is_available()
        raise KeyError("the model's own")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_is_as_before_after_the_forward_raised(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tabled, before = _before(_eager, device)
    with watching(monkeypatch, before) as watch:
        with pytest.raises(KeyError, match="the model's own"):
            tm.estimate(_Raises(), torch.randn(8, 16), device=device)
    assert watch.outside_the_mechanism() == {}
    assert watch.replaced, "nothing was in effect when the step began"
    monkeypatch.undo()
    assert in_effect() == ()
    assert changed(before, picture()) == set()
    assert _same(tabled, _tabled()) == []


def test_a_replacement_made_by_hand_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pictures see a torch attribute replaced around the mechanism (as
    ``torch.meta = ...`` and ``del torch.meta`` were), and one the mechanism holds."""
    before = picture()
    watch = Watch(before)
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # type: ignore[assignment]
    try:
        watch.look()
    finally:
        torch.cuda.get_device_capability = saved
    assert watch.outside_the_mechanism() == {(): {"torch.cuda.get_device_capability"}}
    with torch_replacing.replacing("torch.cuda.get_device_capability", lambda device=None: (9, 0)):
        watch = Watch(before)
        watch.look()
    assert watch.outside_the_mechanism() == {}
    assert watch.replaced == {"torch.cuda.get_device_capability"}
    assert changed(before, picture()) == set()


def _on_another_thread(ask: Callable[[], Any]) -> Any:
    """What ``ask()`` answers on another thread: its value, or the type of what it raised."""
    import threading

    answers: list[Any] = []

    def run() -> None:
        try:
            answers.append(ask())
        except Exception as exc:  # noqa: BLE001 - a torch without a GPU refuses: that is its answer
            answers.append(type(exc))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return answers[0]


def test_a_thread_scoped_replacement_answers_the_tracing_thread_only() -> None:
    path = "torch.cuda.get_device_capability"
    original = torch.cuda.get_device_capability
    elsewhere = _on_another_thread(lambda: torch.cuda.get_device_capability())
    with torch_replacing.on_this_thread(path, lambda device=None: (1, 2)) as found:
        assert found is original
        assert torch.cuda.get_device_capability() == (1, 2)
        assert _on_another_thread(lambda: torch.cuda.get_device_capability()) == elsewhere != (1, 2)
        assert in_effect() == (path,)
    assert torch.cuda.get_device_capability is original
    with pytest.raises(ValueError, match="thread_scoped=True"):
        with torch_replacing.on_this_thread("torch.get_rng_state", lambda: None):
            pass


@pytest.mark.parametrize("path", sorted(path for path, entry in PRIVATE.items() if entry.added))
def test_an_added_entry_is_absent_from_torch_and_only_added_for_its_block(path: str) -> None:
    owner_path, _, name = path.rpartition(".")
    owner = torch_private._resolve(owner_path)
    assert not hasattr(owner, name)
    stand_in = object()
    with pytest.raises(ZeroDivisionError):
        with torch_replacing.replacing(path, stand_in) as found:
            assert found is None and getattr(owner, name) is stand_in
            1 / 0  # noqa: B018
    assert not hasattr(owner, name)


@pytest.mark.parametrize(
    "path", sorted(path for path, entry in PRIVATE.items() if entry.thread_scoped or entry.added)
)
def test_scoped_and_added_entries_are_replaced_ones(path: str) -> None:
    assert PRIVATE[path].replaced


def test_a_config_option_is_put_back_as_torch_kept_it() -> None:
    """An inductor option is set through the config's own patch: after the block the option
    is as it was, default or the user's override, and the config's hash too."""
    config = torch_private.private("torch._inductor.config")
    before = config.get_config_copy(), config.cpp.simdlen
    with torch_replacing.replacing("torch._inductor.config.cpp.simdlen", 256) as found:
        assert found == before[1] and config.cpp.simdlen == 256
    assert (config.get_config_copy(), config.cpp.simdlen) == before
    with pytest.raises(ZeroDivisionError):
        with torch_replacing.replacing("torch._inductor.config.force_disable_caches", True):
            1 / 0  # noqa: B018
    assert config.get_config_copy() == before[0]


def test_a_dict_item_is_put_back_or_taken_out() -> None:
    interfaces = torch_private.private("torch._dynamo.device_interface.device_interfaces")
    before = dict(interfaces)
    path = "torch._dynamo.device_interface.device_interfaces"
    stand_in = object()
    with pytest.raises(ZeroDivisionError):
        with torch_replacing.replacing_item(path, "torchmem-test", stand_in) as found:
            assert found is None and interfaces["torchmem-test"] is stand_in
            1 / 0  # noqa: B018
    assert dict(interfaces) == before
    op = torch.ops.aten.mul.Tensor
    key = torch._C.DispatchKey.AutogradMeta
    cached = dict(op._dispatch_cache)
    with torch_replacing.replacing_item("torch.ops.aten.add.Tensor._dispatch_cache", key, stand_in, within=op):
        assert op._dispatch_cache[key] is stand_in
    assert dict(op._dispatch_cache) == cached


# -- no module writes a torch attribute but through the mechanism ------------------------

PACKAGE = Path(pytest_torchmem.__file__).parent
THE_MECHANISM = "engine/torch_compat/torch_replacing.py"


def _root(node: ast.AST) -> str | None:
    """The name an attribute or subscript chain (``a.b[c].d``) starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_writes(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every write into torch ``source`` makes by hand: an assignment,
    ``del`` or augmented assignment whose target is an attribute or item of a name bound to
    torch (``import torch.x as y``, ``from torch import x``, ``y = private("torch....")``),
    and ``setattr``/``delattr`` on one."""
    tree = ast.parse(source)
    bound = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update(alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            bound.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id in ("private", "private_any"):
                bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)) and _root(target) in bound:
                found.append((node.lineno, ast.unparse(node).splitlines()[0]))
    return sorted(found)


def test_no_module_writes_a_torch_attribute_by_hand() -> None:
    """Every write into torch is torch_replacing's (replacing, appending, replacing_item):
    in the table, entered and left in one place."""
    strays = {
        path.relative_to(PACKAGE).as_posix(): writes
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() != THE_MECHANISM
        for writes in [torch_writes(path.read_text(encoding="utf-8"))]
        if writes
    }
    assert not strays, "torch written by hand:\n" + "\n".join(
        f"  pytest_torchmem/{module}:{line}: {code}" for module, writes in strays.items() for line, code in writes
    )


def test_the_scan_sees_every_write() -> None:
    source = """
import torch
import torch.distributed as dist
from torch import cuda
interfaces = private("torch._dynamo.device_interface.device_interfaces")
torch.meta = object()
del torch.meta
dist.all_reduce = None
cuda.get_device_capability = None
interfaces["cuda"] = None
setattr(torch.cuda, "is_available", None)
torch.x.y += 1
mine = {}
mine["cuda"] = None
other.attr = 1
"""
    assert [line for line, _ in torch_writes(source)] == [6, 7, 8, 9, 10, 11, 12]
