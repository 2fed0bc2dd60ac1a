"""The program inductor builds for a GPU, built and run without one.

On the fake ``cuda`` device a compiled module is estimated as inductor's cuda
program runs: AOTAutograd traces and partitions the module on the trace's
fake ``meta`` tensors (autograd on a fake ``cuda`` tensor kills a CPU-only
torch), with the device's router active, so that the joint graph holds the
kernels CUDA dispatch picks (the attention backend, cuDNN batch norm) and the
gradients autograd takes for cuda tensors (:func:`_autograd_as_on_cuda`); then
each partitioned graph is handed to inductor with its values on ``cuda``:
inductor lowers it, fuses and plans its buffers with its cuda backend
(triton's scheduling, the Python wrapper's buffer reuse), the code path a GPU
machine takes, while the hardware queries are answered from the GPU profile
and no kernel is compiled (see :mod:`inductor_device`). The wrapper's
allocations (``empty_strided_cuda``) and views are made on the trace's fake
tensors, where the tracker charges them through the caching-allocator model,
and the extern kernels it calls (cuBLAS matmuls, attention, convolutions) are
charged by the cuda rules.

What is not built as on a GPU machine is a :class:`Gap`, listed in
``unsupported`` where it applies: the joint-graph passes see the trace's
``meta`` device, so inductor's device-dependent rewrites there take their
non-cuda branch (``pad_mm`` pads no matmul, ``fuse_attention`` checks TF32
only on cuda); choices inductor makes by benchmarking on the GPU
(``max_autotune``) are not made; CUDA graphs (``mode="reduce-overhead"``)
are modelled by their private pool.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import torch

from pytest_torchmem.engine.torch_compat.torch_private import present, private
from pytest_torchmem.engine.torch_compat.torch_replacing import on_this_thread, replacing, replacing_item
from pytest_torchmem.engine.tracing.devices.cuda.gpu_view import autocast_opens_cuda_regions
from pytest_torchmem.engine.tracing.devices.cuda.profiles import GpuProfile
from pytest_torchmem.engine.tracing.inductor_device import Enter, as_the_gpu, unguarded

__all__ = ["CudaProgram", "Gap", "GRAPH_POOL", "without_function_modes"]

# torch's private names (engine/torch_compat/torch_private.py)
_FAKE_TENSOR: Final = "torch._subclasses.fake_tensor.FakeTensor"
FakeTensor: Final = private(_FAKE_TENSOR)
_len_torch_function_stack: Final = private("torch._C._len_torch_function_stack")
_pop_torch_function_stack: Final = private("torch._C._pop_torch_function_stack")
_push_on_torch_function_stack: Final = private("torch._C._push_on_torch_function_stack")
_disable_current_modes: Final = private("torch.utils._python_dispatch._disable_current_modes")

_GPU: Final = torch.device("cuda", 0)


# -- the partitioned graphs, moved to cuda ---------------------------------------------


class _ToGpu:
    """Fake ``cuda`` twins of a graph's fake ``meta`` values: one storage per storage
    (views keep sharing theirs), none requiring grad (no autograd on cuda fakes)."""

    def __init__(self, fake_mode: Any) -> None:
        self.fake_mode = fake_mode
        self.storages: dict[int, torch.Tensor] = {}
        self.done: dict[int, torch.Tensor] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, FakeTensor):
            return self.tensor(value) if value.fake_device.type == "meta" else value
        if isinstance(value, torch.device):
            return _GPU if value.type == "meta" else value
        if isinstance(value, (list, tuple)):
            return type(value)(self(v) for v in value)
        return value

    def tensor(self, t: FakeTensor) -> torch.Tensor:
        found = self.done.get(id(t))
        if found is not None:
            return found
        storage = t.untyped_storage()
        with self.fake_mode:
            base = self.storages.get(storage._cdata)
            if base is None:
                base = torch.empty((storage.nbytes(),), dtype=torch.uint8, device=_GPU)
                self.storages[storage._cdata] = base
            twin = torch.empty((0,), dtype=t.dtype, device=_GPU)
            twin.set_(base.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        self.done[id(t)] = twin
        return twin


def _to_gpu(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """Move a partitioned graph and its example inputs from the trace's ``meta`` to
    ``cuda``: the values of its nodes and the devices its nodes name."""
    detect_fake_mode = private("torch._guards.detect_fake_mode")
    fake_mode = detect_fake_mode(example_inputs) or private("torch._guards.TracingContext").get().fake_mode
    move = _ToGpu(fake_mode)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = move(node.meta["val"])
        node.args = torch.fx.node.map_aggregate(node.args, move)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, move)
    gm.recompile()
    return [move(t) for t in example_inputs]


@contextmanager
def without_function_modes() -> Iterator[None]:
    """No torch-function mode active (the router's placement would send inductor's
    own cuda tensors to the trace device)."""
    modes = []
    while _len_torch_function_stack() > 0:
        modes.append(_pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_on_torch_function_stack(mode)


@contextmanager
def _meta_outputs_computed() -> Iterator[None]:
    """Keep the joint graph's computations: its values live on the trace's ``meta``
    device, whose outputs inductor's ``remove_no_ops`` replaces with ``empty_strided``
    (a meta tensor has no data); for the GPU they stand for, the visit that does it
    is told that they are on ``cuda`` (only that visit: everything else in the joint
    passes sees ``meta``)."""
    device_of = FakeTensor.device.fget
    visit = "remove_no_ops.<locals>.visit"
    tracing = threading.get_ident()

    def device(self: FakeTensor) -> torch.device:
        seen = device_of(self)
        if (
            seen.type == "meta"
            and sys._getframe(1).f_code.co_qualname == visit
            and threading.get_ident() == tracing
        ):
            return _GPU
        return seen

    def remove_no_ops(*args: Any, **kwargs: Any) -> Any:
        with replacing(f"{_FAKE_TENSOR}.device", property(device)):
            return real_remove(*args, **kwargs)

    with replacing("torch._inductor.fx_passes.joint_graph.remove_no_ops", remove_no_ops) as real_remove:
        yield


@contextmanager
def _random_ops_replaced() -> Iterator[None]:
    """Let inductor's ``replace_random`` pass replace the joint graph's ``aten.rand`` (a
    dropout's mask) by its own random op, as on a GPU: its pattern matcher skips a node
    whose values it cannot generate code for, which a ``meta`` tensor is (then inductor's
    lowering refuses ``aten.rand``: the whole region fell back to eager figures); for
    the GPU those values stand for, that check is told they are not ``meta``."""
    real_check: Callable[..., bool]  # fallback_node_due_to_unsupported_type, bound below

    def check(node: torch.fx.Node, allow_cpu_inputs: bool = True) -> bool:
        with replacing(f"{_FAKE_TENSOR}.is_meta", property(lambda self: False)):
            return real_check(node, allow_cpu_inputs)

    def replace_random_passes(gm: torch.fx.GraphModule) -> int:
        nonlocal real_check
        with replacing("torch._inductor.pattern_matcher.fallback_node_due_to_unsupported_type", check) as real_check:
            return real_pass(gm)

    with replacing("torch._inductor.fx_passes.joint_graph.replace_random_passes", replace_random_passes) as real_pass:
        yield


@contextmanager
def _dynamo_sees_the_gpu(router: Callable[[], Any]) -> Iterator[None]:
    """While dynamo traces a compiled region's code: the code sees its tensors on
    ``cuda`` (``x.device``, ``x.is_cuda``), as on a GPU, not on the trace's ``meta``
    device, and so does dynamo where it makes an optimizer step capturable (its
    parameters are on a GPU); what the code makes on ``cuda`` is placed on ``meta`` by
    the device's router while dynamo runs each op on its fake values (and while
    AOTAutograd traces the graph: :meth:`CudaProgram.compile`)."""
    placing = router()

    def specialize(value: torch.Tensor) -> dict[str, Any]:
        props = real_specialize(value)
        if props["device"].type == "meta":
            props["device"] = _GPU
        return props

    def run_node(tracer: Any, node: torch.fx.Node, args: Any, kwargs: Any, nnmodule: Any) -> Any:
        with placing:
            return real_run_node(tracer, node, args, kwargs, nnmodule)

    def capturable(*args: Any) -> Any:
        # (a compiled optimizer step: dynamo makes it capturable where every parameter is
        # on a GPU, and its state's step counters are then made there, not on the host)
        with replacing(f"{_FAKE_TENSOR}.is_cuda", _ON_CUDA):
            return real_capturable(*args)

    specializing = "torch._dynamo.variables.tensor.TensorVariable.specialize"
    with (
        replacing(specializing, staticmethod(specialize)) as real_specialize,
        replacing("torch._dynamo.utils.run_node", run_node) as real_run_node,
        replacing(_asks_for_the_gpu(), capturable) as real_capturable,
    ):
        yield


@functools.cache
def _asks_for_the_gpu() -> str:
    """Where dynamo asks whether a compiled optimizer step's parameters are on a GPU (read
    once: each compiled region the trace enters replaces it)."""
    optimizer = "torch._dynamo.variables.optimizer.OptimizerVariable"
    if present(f"{optimizer}._safe_to_set_capturable"):
        return f"{optimizer}._safe_to_set_capturable"  # (torch 2.15: per parameter group)
    return f"{optimizer}._set_capturable"


#: ``is_cuda`` of the trace's tensors as a GPU's: its ``meta`` device stands for cuda.
_ON_CUDA: Final = property(lambda t: t.fake_device.type in ("meta", "cuda"))


def _copy_misaligned_inputs(
    new_inputs: list[Any], check_inputs_idxs: Sequence[int], return_pair_idxs: Any = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inductor's check, as a compiled program makes it on the GPU when it runs: an input
    it took to be aligned whose address is not (``data_ptr() % ALIGNMENT``) is cloned,
    with its strides, before the program runs. A fake tensor has no address; a block of
    the caching allocator is 512-byte aligned, so an input's address is aligned where
    its storage offset is, in bytes."""
    alignment = private("torch._inductor.utils.ALIGNMENT")
    clone_preserve_strides = private("torch._inductor.utils.clone_preserve_strides")
    old: list[torch.Tensor] = []
    new: list[torch.Tensor] = []
    for i in check_inputs_idxs:
        tensor = new_inputs[i]
        if tensor.storage_offset() * tensor.element_size() % alignment:
            new_inputs[i] = clone_preserve_strides(tensor)
            if return_pair_idxs is not None and i in return_pair_idxs:
                old.append(tensor)
                new.append(new_inputs[i])
    return old, new


#: Inductor options whose choices are made by benchmarking on the GPU, not made here.
_AUTOTUNING: Final = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise")


@dataclass(frozen=True)
class Gap:
    """A part of a compiled module's cuda program that the estimate does not build as a
    GPU machine would (those met are in :attr:`CudaProgram.gaps`)."""

    what: str
    why: str


#: Inductor's choices made by benchmarking on the GPU.
AUTOTUNE_GAP: Final = Gap(
    "max-autotune",
    "inductor picks its matmul and convolution kernels (triton templates, whose epilogue "
    "fusion saves the output buffer of the op they fuse) by benchmarking them on the GPU; "
    "the estimate takes aten's kernels, as without max-autotune",
)
#: ``pad_mm``: the joint-graph pass pads a matmul on a GPU when its benchmark says so.
PAD_MM_GAP: Final = Gap(
    "pad_mm",
    "inductor may pad this matmul's dimensions to the alignment of its dtype (8 for "
    "fp16/bf16, 4 for fp32) when benchmarking on the GPU finds the padded one faster "
    "(zero-padded copies of the operands and a larger product); the estimate keeps it unpadded",
)
#: ``fuse_attention``: a matmul-softmax-matmul pattern replaced by attention.
FUSED_ATTENTION_GAP: Final = Gap(
    "fuse_attention",
    "inductor replaced a hand-written attention (matmul, softmax, matmul) with "
    "scaled-dot-product attention in the joint graph, whose passes see the trace's meta "
    "device: on cuda the pass leaves an fp32 pattern as it is unless TF32 is on, and keeps "
    "one pattern (BERT's) as math",
)


#: ``mode="reduce-overhead"``: CUDA graphs (cudagraph trees) with their private pool.
CUDA_GRAPHS_GAP: Final = Gap(
    "CUDA graphs",
    "the compiled graphs run as CUDA graphs (cudagraph trees): modelled as the default "
    "mode's program whose allocations come from a private pool of the caching allocator "
    "(blocks only the graphs reuse), with each input that is not a parameter, a buffer or "
    "an output of an earlier graph copied into the pool; the figures are the recording "
    "step's (a replay allocates nothing: on a GPU, max_memory_allocated of a replayed step "
    "shows the eager allocations only, and the pool stays reserved); the warm-up run, "
    "re-recording and the pool's checkpointed state are not modelled",
)

#: The allocator pool of a CUDA graph's allocations (``StorageInfo.pool``).
GRAPH_POOL: Final = 1


class PoolTracker(Protocol):
    """What :class:`CudaProgram` needs of the tracker: the pool new storages are charged to."""

    def charge_to(self, pool: int) -> int: ...

    def pool_of(self, t: torch.Tensor) -> int | None: ...


@dataclass
class CudaProgram:
    """Builds a compiled module's cuda program (a dynamo backend's compile step) and
    enters it in the traced step; records what of it is inexact (:attr:`gaps`)."""

    profile: GpuProfile
    trace_device: torch.device
    router: Callable[[], Any]
    tracker: PoolTracker
    gaps: list[Gap] = field(default_factory=list)

    def compile(self, wrapper: Any, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """``wrapper(gm, example_inputs)`` (the user's inductor options), with
        AOTAutograd on the trace's device under the router and inductor for cuda."""
        counters = private("torch._dynamo.utils.counters")
        compile_fx = private("torch._inductor.compile_fx.compile_fx")
        options = dict(wrapper.config)
        if any(options.get(name) for name in _AUTOTUNING):
            self._gap(AUTOTUNE_GAP)
            options.update(dict.fromkeys(_AUTOTUNING, False))
        graphs = bool(options.get("triton.cudagraphs"))
        if graphs:
            # the same program, its allocations charged to a pool of its own (_in_graph_pool)
            self._gap(CUDA_GRAPHS_GAP)
            options["triton.cudagraphs"] = False
        fused = counters["inductor"]["fuse_attention"]
        with (
            self.router(),
            _as_in_cuda_decompositions(),
            _scalars_keep_their_values(),
            _autograd_as_on_cuda(),
            _meta_outputs_computed(),
            _random_ops_replaced(),
        ):
            program = compile_fx(
                gm,
                example_inputs,
                inner_compile=functools.partial(self._inner, graphs=graphs),
                config_patches=options,
                compile_region_name=wrapper.name,
            )
        if counters["inductor"]["fuse_attention"] != fused:
            self._gap(FUSED_ATTENTION_GAP)
        return program

    def around(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """Enter the compiled module with no torch-function mode active, as in the
        warm-up that compiled it (dynamo's cache entries guard on the mode stack): the
        device's router routes the traced step around it, not inside it; dynamo sees
        the module's tensors and its autocast regions as a GPU's."""

        def entered(*args: Any, **kwargs: Any) -> Any:
            with self.entering():
                return call(*args, **kwargs)

        return entered

    @contextmanager
    def entering(self) -> Iterator[None]:
        """While a compiled module or function runs (see :meth:`around`)."""
        with (
            without_function_modes(),
            _dynamo_sees_the_gpu(self.router),
            autocast_opens_cuda_regions(self.profile),
            replacing("torch._inductor.utils.copy_misaligned_inputs", _copy_misaligned_inputs),
        ):
            yield

    def _inner(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, graphs: bool, **kwargs: Any
    ) -> Any:
        compile_fx_inner = private("torch._inductor.compile_fx.compile_fx_inner")
        if any(_may_pad(node) for node in gm.graph.nodes):
            self._gap(PAD_MM_GAP)
        enter = self._in_graph_pool(frozenset(kwargs.get("static_input_idxs", ()))) if graphs else None
        # (no grad: an op autograd records on a cuda fake tensor aborts a CPU-only torch;
        # no dispatch mode: AOTAutograd compiles a backward lazily, at its first run, where
        # the warm-up's tracker would place the graph's cuda values on the trace's device)
        gpu = as_the_gpu(self.profile, self.trace_device, enter)
        with torch.no_grad(), _disable_current_modes(), without_function_modes(), gpu, unguarded():
            return compile_fx_inner(gm, _to_gpu(gm, example_inputs), **kwargs)

    def _in_graph_pool(self, static: frozenset[int]) -> Enter:
        """A graph run as a CUDA graph (``cudagraphify`` in cudagraph_trees.py): what it
        allocates comes from the graphs' private pool, and each input that is neither
        static (parameters, buffers, saved tensors of the forward graph) nor already in
        the pool (an earlier graph's output) is first copied into it
        (``_allocate_and_copy_recording_inputs``: ``static_input``, a fresh tensor of the
        same strides, then a copy)."""
        tracker = self.tracker

        def enter(call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
            def run(args: list[Any]) -> Any:
                outer = tracker.charge_to(GRAPH_POOL)
                try:
                    for i, arg in enumerate(args):
                        if i in static or not isinstance(arg, torch.Tensor):
                            continue
                        if tracker.pool_of(arg) == GRAPH_POOL:
                            continue
                        copy = torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device)
                        args[i] = copy.copy_(arg)
                    return call(args)
                finally:
                    tracker.charge_to(outer)

            return run

        return enter

    def _gap(self, gap: Gap) -> None:
        if gap not in self.gaps:
            self.gaps.append(gap)


_MATMULS: Final = {
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.bmm.default: (0, 1),
}


def _may_pad(node: torch.fx.Node) -> bool:
    """Whether ``pad_mm`` could pad this matmul on a GPU (``can_pad``, pad_mm.py: float
    operands with a static dimension, not a multiple of the dtype's alignment, other
    than 1); whether it does is the GPU's benchmark's say."""
    positions = _MATMULS.get(node.target) if node.op == "call_function" else None
    if positions is None or not private("torch._inductor.config").shape_padding:
        return False
    mat1, mat2 = (node.args[i].meta.get("val") for i in positions)  # type: ignore[union-attr]
    if not (isinstance(mat1, torch.Tensor) and isinstance(mat2, torch.Tensor)):
        return False
    if not (mat1.is_floating_point() and mat2.is_floating_point()):
        return False
    batch = 1 if node.target is torch.ops.aten.bmm.default else 0
    m, k, n = mat1.shape[batch], mat1.shape[batch + 1], mat2.shape[batch + 1]
    if any(isinstance(d, int) and d == 0 for d in (m, k, n)):
        return False
    get_alignment_size = private("torch._inductor.fx_passes.pad_mm.get_alignment_size")
    get_padded_length = private("torch._inductor.fx_passes.pad_mm.get_padded_length")
    return any(
        get_padded_length(d, get_alignment_size(t)) != 0 for d, t in ((m, mat1), (k, mat1), (n, mat2))
    )


@contextmanager
def _as_in_cuda_decompositions() -> Iterator[None]:
    """Inductor's decompositions, as they run for cuda tensors: the joint graph is
    traced on the trace's ``meta`` tensors, which ``convolution_backward``'s
    decomposition (a GPU's bias gradient is a reduction of its own) asks about."""
    real: Callable[[str | None], bool]  # decomposition.is_gpu, bound below

    def is_gpu(device: str | None) -> bool:
        return device == "meta" or real(device)

    with replacing("torch._inductor.decomposition.is_gpu", is_gpu) as real:
        yield


@contextmanager
def _scalars_keep_their_values() -> Iterator[None]:
    """A one-element tensor the joint graph makes from a Python number on the trace's
    ``meta`` device (torch 2.15's decomposition of ``_foreach_lerp`` makes its weight so,
    on its inputs' device) is made on the host instead, where it keeps its value: the
    graph holds it as a constant, which inductor inlines by its value (``.item()``), as
    it inlines the GPU's. A ``meta`` constant has no value, and the program could not be
    built; a host scalar mixes with the GPU's tensors as a GPU's own does."""
    real: Callable[..., torch.Tensor]  # torch.tensor, bound below

    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        number = isinstance(data, (bool, int, float, complex))
        if number and device is not None and torch.device(device).type == "meta":
            device = "cpu"
        return real(data, *args, device=device, **kwargs)

    with on_this_thread("torch.tensor", tensor) as real:
        yield


#: The Python dispatcher's cache of each overload (the entry names one overload's).
_DISPATCH_CACHE: Final = "torch.ops.aten.add.Tensor._dispatch_cache"


@contextmanager
def _autograd_as_on_cuda() -> Iterator[None]:
    """The joint graph's autograd, as it is traced for cuda tensors. AOTAutograd traces
    on the trace's ``meta`` tensors under the Python dispatcher, whose ``resolve_key``
    (torch/_ops.py) takes an op's ``CompositeImplicitAutograd`` kernel for an autograd
    key only where the op has no kernel of that key's backend; ``activate_meta``
    (_meta_registrations.py) gives a Python ``Meta`` kernel to every op with a
    decomposition, composite ones included (``nll_loss``, ``var``, ``where.ScalarOther``,
    ``relu6``, ...). So on ``meta`` such an op skips its composite, falls to autograd's
    fallback for a kernel with no derivative, and gives no gradient: the backward graph
    loses every gradient behind it (a compiled model computing its loss with
    ``cross_entropy`` would have no parameter gradients). On cuda the op has no kernel
    of its backend, and its autograd key runs the composite. While the joint graph is
    traced, ``AutogradMeta`` of these ops resolves to their composite (the operator's
    dispatch cache, seeded here, restored after); an op with a derivative of its own
    is left as it is."""
    DispatchKey = private("torch._C.DispatchKey")
    OpOverload = private("torch._ops.OpOverload")
    resolve_key = private("torch._ops.resolve_key")
    global_decomposition_table = private("torch._decomp.global_decomposition_table")
    composite = DispatchKey.CompositeImplicitAutograd
    ops = {op for table in global_decomposition_table.values() for op in table if isinstance(op, OpOverload)}
    with ExitStack() as seeded:
        for op in ops:
            try:
                lost = resolve_key(op, DispatchKey.AutogradMeta) == DispatchKey.AutogradMeta
                if not (lost and resolve_key(op, DispatchKey.AutogradCUDA) == composite):
                    continue
            except NotImplementedError:
                continue
            kernel = op.py_kernels.get(composite, composite)
            seeded.enter_context(replacing_item(_DISPATCH_CACHE, DispatchKey.AutogradMeta, kernel, within=op))
        yield
