"""Every private torch name the engine reads or replaces, in one table.

torch promises nothing of its private names (``torch._prims_common``,
``torch._inductor``, ``torch._C._...``): a minor release moves, renames or
removes them. The engine reaches them through this module only, so that each
one is written down once, with why it is used and in which releases it exists,
and is checked against the running torch when first used:

- :func:`private` resolves a dotted path (``"torch._prims_common.suggest_memory_format"``);
- :func:`private_op` gives an aten overload that only some releases have (None elsewhere).

Every run-time replacement of a torch attribute goes through one mechanism, the
functions below, each an entry of the table marked ``replaced`` (what, why,
which releases; ``thread_scoped`` where only the tracing thread may see it,
``added`` where torch has no such attribute): entered for a block, put back
however the block ends, on exception too.

- :func:`replacing` replaces an attribute (a module's global, a class's attribute,
  an option of a torch config module) or adds one torch lacks;
- :func:`appending` adds an item to a private list;
- :func:`replacing_item` sets one key of a private dict;
- :func:`in_effect` says which are in effect now (the tests read it).

A path missing from the running torch raises :class:`TorchPrivateError`, one
line that names it, what it served and the supported window, never an
``AttributeError`` from deep inside a rule. ``tests/test_torch_private.py``
resolves every entry on the running torch, and CI runs it on every release of
the window.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from pytest_torchmem.engine.torch_release import (
    SUPPORTED,
    TorchReleaseError,
    supported_range,
)

__all__ = [
    "COMPILED_ENTRIES",
    "PRIVATE",
    "Private",
    "TorchPrivateError",
    "appending",
    "in_effect",
    "on_this_thread",
    "present",
    "private",
    "private_any",
    "private_name",
    "private_op",
    "replacing",
    "replacing_item",
    "swapped",
]

Release = tuple[int, int]


class TorchPrivateError(TorchReleaseError):
    """A private torch name the engine needs is not in the running torch."""


@dataclass(frozen=True)
class Private:
    """One private torch name: its dotted ``path``, ``why`` the engine uses it,
    the releases that have it as used (``since``/``until``, both included;
    None: the whole window), whether the engine replaces it at run time, and
    whether only CUDA builds of torch have it (``cuda_only``: a binding that a
    CPU-only build does not compile).

    Of a replaced name: ``thread_scoped``, only the thread that replaced it (the
    tracing thread) gets the replacement's answers, every other thread the
    original's; ``added``, torch has no such attribute in any release of the
    window, and the replacement adds it for its block."""

    path: str
    why: str
    since: Release | None = None
    until: Release | None = None
    replaced: bool = False
    cuda_only: bool = False
    thread_scoped: bool = False
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


def _entries(*entries: Private) -> dict[str, Private]:
    table: dict[str, Private] = {}
    for entry in entries:
        if entry.path in table:
            raise ValueError(f"{entry.path} is in the table twice")
        table[entry.path] = entry
    return table


#: The private names of compiled models (torch.compile): the watch of compiled regions,
#: our dynamo cache regions, and inductor's program followed on fake cpu and cuda tensors.
#: Every one is present wherever a compiled region is followed (see
#: pytest_torchmem.engine.tracing.compiled.following_blocked): one missing lists each
#: compiled region in ``unsupported`` with its name, never an AttributeError mid-compile.
COMPILED_ENTRIES: Final = (
    Private(
        "torch._dynamo.eval_frame._maybe_set_eval_frame",
        "the call by which dynamo's compile_wrapper enters a compiled region: the watch of "
        "compiled regions sees each one there and runs it followed, or eagerly and flagged",
        replaced=True,
    ),
    Private(
        "torch._dynamo.eval_frame.set_fullgraph_compiled_frame_count",
        "fullgraph=True counts the frames dynamo compiled in a call and refuses a call that "
        "compiled none ('found no compiled frames'): a region the watch runs eagerly on "
        "purpose, flagged, is read back as one",
        since=(2, 12),
        replaced=True,
    ),
    Private(
        "torch._dynamo.eval_frame.OptimizedModule",
        "a module compiled with torch.compile(module) (module.compile() sets _compiled_call_impl)",
    ),
    Private(
        "torch._TorchCompileInductorWrapper",
        "torch.compile's inductor backend: the regions whose programs are followed",
    ),
    Private(
        "torch._dynamo.eval_frame._next_isolate_recompiles_id",
        "a dynamo cache region of our own (torch._dynamo.optimize(isolate_recompiles=True), "
        "torch 2.13): our compiles never count against the user's recompile_limit; earlier "
        "releases have one cache per code object, so compiled regions are not followed there "
        "and are listed in unsupported",
        since=(2, 13),
    ),
    Private(
        "torch._C._dynamo.eval_frame.set_eval_frame_isolate_recompiles_id",
        "enters our cache region for a compiled function the user's compile_wrapper entered",
        since=(2, 13),
    ),
    Private(
        "torch._dynamo.eval_frame._get_cache_entries_for_region",
        "the cache entries of our cache regions, invalidated when the estimate or measurement ends",
        since=(2, 13),
    ),
    Private(
        "torch._dynamo.convert_frame.input_codes",
        "every code object dynamo compiled: where our cache regions' entries are",
    ),
    Private(
        "torch._dynamo.guards.DeletedGuardManagerWrapper",
        "invalidates one of our cache entries (no guard passes it; dynamo drops its program)",
    ),
    Private(
        "torch._dynamo.optimize",
        "builds our dynamo context for a compiled region: the fake inductor backend, the "
        "user's fullgraph and dynamic, isolate_recompiles",
    ),
    Private(
        "torch._dynamo.external_utils.wrap_inline",
        "as OptimizedModule._initialize wraps a module's top frame, for our compiled forward",
    ),
    Private(
        "torch._dynamo.trace_rules.check",
        "as OptimizedModule._initialize: whether dynamo would skip the module's forward",
    ),
    Private(
        "torch._dynamo.config.wrap_top_frame",
        "as OptimizedModule._initialize: whether the top frame is wrapped",
    ),
    Private(
        "torch._dynamo.utils.counters",
        "inductor's count of autotuned kernel choices (select_algorithm_autotune): "
        "autotuning is listed",
    ),
    Private(
        "torch._inductor.async_compile.AsyncCompile.cpp",
        "builds a C++ kernel: a no-op while the estimate compiles",
        replaced=True,
    ),
    Private(
        "torch._inductor.async_compile.AsyncCompile.cpp_pybinding",
        "builds a C++ kernel with Python bindings: a no-op while the estimate compiles",
        replaced=True,
    ),
    Private(
        "torch._inductor.async_compile.AsyncCompile.wait",
        "awaits the kernels compiled: nothing to await while the estimate compiles",
        replaced=True,
    ),
    Private(
        "torch._inductor.async_compile.AsyncCompile.triton",
        "builds a triton kernel: none is built for the fake cuda device",
        replaced=True,
    ),
    Private(
        "torch._inductor.codecache.PyCodeCache.load_by_key_path",
        "loads an output module: ours run their allocations through the dispatcher, kept "
        "out of the by-path cache",
        replaced=True,
    ),
    Private(
        "torch._inductor.codecache.PyCodeCache.modules",
        "every output module loaded: ours are dropped from it on exit",
    ),
    Private(
        "torch._inductor.config",
        "inductor's configuration: the options an estimate's compile sets (each tabled below)",
    ),
    Private(
        "torch._dynamo.config",
        "dynamo's configuration: the options an estimate's compile reads (each tabled)",
    ),
    Private(
        "torch._inductor.codecache.PyCodeCache",
        "inductor's cache of output modules: ours are dropped from its modules on exit",
    ),
    Private(
        "torch._inductor.config.force_disable_caches",
        "no FX graph, AOTAutograd or autotuning cache read or written while the estimate compiles",
        replaced=True,
    ),
    Private(
        "torch._inductor.config.compile_threads",
        "one compile thread while the estimate compiles (no kernel is built)",
        replaced=True,
    ),
    Private(
        "torch._inductor.config.cpp.simdlen",
        "the vector width inductor builds for: the CPU profile's",
        replaced=True,
    ),
    Private(
        "torch._inductor.config.cpp.threads",
        "the threads inductor sizes its kernels for: the CPU profile's",
        replaced=True,
    ),
    Private(
        "torch._inductor.config.cpp.vec_isa_ok",
        "inductor takes the vector ISA without probing a compile of it",
        replaced=True,
    ),
    Private(
        "torch._inductor.config.shape_padding",
        "whether pad_mm may pad a matmul (a gap of the cuda program listed)",
    ),
    Private(
        "torch._inductor.cpu_vec_isa.valid_vec_isa_list",
        "the vector ISAs this CPU has: the profile's only, probed without compiling",
        replaced=True,
    ),
    Private(
        "torch._inductor.cpu_vec_isa.x86_isa_checker",
        "the x86 ISA flags of this CPU, read without compiling a probe",
    ),
    Private(
        "torch._inductor.cpu_vec_isa.supported_vec_isa_list",
        "the vector ISAs inductor knows",
    ),
    Private(
        "torch._inductor.cpu_vec_isa.VecAVX2",
        "inductor's ISA of the avx2 level",
    ),
    Private(
        "torch._inductor.cpu_vec_isa.VecAVX512",
        "inductor's ISA of the avx512 levels",
    ),
    Private(
        "torch._inductor.cpu_vec_isa.VecAMX",
        "inductor's ISA of the amx level",
    ),
    Private(
        "torch._inductor.compile_fx.with_fresh_cache_if_config",
        "where inductor writes an output module with its caches off: a directory of "
        "ours, deleted on exit",
        replaced=True,
    ),
    Private(
        "torch._inductor.compile_fx.compile_fx",
        "inductor's compile of one graph, for the fake cuda device's program",
    ),
    Private(
        "torch._inductor.compile_fx.compile_fx_inner",
        "inductor's compile of a partitioned graph, for the fake cuda device's program",
    ),
    Private(
        "torch._inductor.utils.fresh_cache",
        "a cache directory of ours for the output modules",
    ),
    Private(
        "torch._inductor.scheduler.has_triton",
        "the scheduler refuses a cuda graph without triton; no triton kernel is built",
        replaced=True,
    ),
    Private(
        "torch._inductor.runtime.hints.DeviceProperties.create",
        "the GPU inductor builds for: the profile's",
        replaced=True,
    ),
    Private(
        "torch._dynamo.device_interface.get_interface_for_device",
        "registers dynamo's device interfaces before ours replaces cuda's",
    ),
    Private(
        "torch._dynamo.device_interface.device_interfaces",
        "dynamo's device interfaces: cuda's (keys 'cuda' and 'cuda:0') answers as the "
        "profile's GPU while inductor compiles for the fake cuda device",
        replaced=True,
    ),
    Private(
        "torch._dynamo.device_interface.CudaInterface",
        "the interface the profile's GPU is made from",
    ),
    Private(
        "torch._inductor.fx_passes.joint_graph.remove_no_ops",
        "keeps the joint graph's computations on the fake cuda device (meta values read "
        "as cuda there)",
        replaced=True,
    ),
    Private(
        "torch._inductor.fx_passes.joint_graph.replace_random_passes",
        "replaces a dropout's aten.rand by inductor's random op, as on a GPU",
        replaced=True,
    ),
    Private(
        "torch._inductor.pattern_matcher.fallback_node_due_to_unsupported_type",
        "the check replace_random_passes skips meta values with: told they are the GPU's",
        replaced=True,
    ),
    Private(
        "torch._inductor.fx_passes.pad_mm.get_alignment_size",
        "the alignment pad_mm pads a matmul to (a gap of the cuda program listed)",
    ),
    Private(
        "torch._inductor.fx_passes.pad_mm.get_padded_length",
        "the length pad_mm pads a matmul's dimension to",
    ),
    Private(
        "torch._inductor.decomposition.is_gpu",
        "whether inductor decomposes for a GPU: the fake cuda device is one",
        replaced=True,
    ),
    Private(
        "torch._inductor.inductor_prims",
        "registers inductor's prims before the fake cuda device's rules read them",
    ),
    Private(
        "torch._subclasses.fake_tensor.FakeTensor.is_meta",
        "the check replace_random_passes makes of a value: a fake cuda tensor is not meta there",
        replaced=True,
    ),
    Private(
        "torch._dynamo.variables.tensor.TensorVariable.specialize",
        "dynamo's view of a tensor's device: the fake cuda device's tensors are cuda there",
        replaced=True,
    ),
    Private(
        "torch._dynamo.utils.run_node",
        "dynamo runs each op on its fake values: placed by the device's router",
        replaced=True,
    ),
    Private(
        "torch._guards.TracingContext",
        "the fake mode of the graph inductor compiles for cuda",
    ),
    Private(
        "torch._guards.detect_fake_mode",
        "the fake mode of the graph inductor compiles for cuda",
    ),
    Private(
        "torch._decomp.decomposition_table",
        "the decompositions FakeTensorMode reads at each dispatch: wrapped while a cuda "
        "program runs so that each runs without the binding's device guard",
        replaced=True,
    ),
    Private(
        "torch.utils._triton.triton_hash_with_backend",
        "the triton version inductor keys a cuda program by; no triton kernel is built",
        replaced=True,
    ),
    Private(
        "torch._decomp.global_decomposition_table",
        "the decompositions the fake cuda device runs without the CUDA device guard",
    ),
    Private(
        "torch._ops.resolve_key",
        "the kernel a dispatch key resolves to (the fake cuda device's decompositions)",
    ),
    Private(
        "torch.ops.aten.add.Tensor._dispatch_cache",
        "the Python dispatcher's cache of the kernel each dispatch key resolves to, which "
        "every aten overload holds (this one's stands for all): while AOTAutograd traces a "
        "cuda program's joint graph on meta, the ops that lose their gradient there resolve "
        "AutogradMeta to their composite, as AutogradCUDA does (compiled_cuda)",
        replaced=True,
    ),
)


#: The table: private path -> its entry.
PRIVATE: Final = _entries(
    # -- strides and memory formats (the prims' reference helpers) ------------------
    Private(
        "torch._prims_common.suggest_memory_format",
        "the memory format a kernel's output takes (conv, pool, norm, padding rules)",
    ),
    Private(
        "torch._prims_common.make_contiguous_strides_for",
        "the strides of a contiguous buffer a kernel allocates (FFT rules)",
    ),
    Private(
        "torch._prims_common.make_channels_last_strides_for",
        "the strides of a channels-last buffer a kernel allocates (conv rules)",
    ),
    Private(
        "torch._prims_common.are_strides_like_channels_last_or_false",
        "whether a tensor's strides read as channels-last (conv rules)",
    ),
    Private(
        "torch._prims_common.compute_elementwise_output_strides",
        "the strides TensorIterator gives an elementwise output (misc rules)",
    ),
    Private(
        "torch._prims_common.is_non_overlapping_and_dense_or_false",
        "whether a tensor is dense, as TensorIterator and cuBLAS ask (indexing, BLAS rules); "
        "2.10 names it is_non_overlapping_and_dense (torch/_prims_common/__init__.py: "
        "2.10.0 line 521, 2.11.0 line 524)",
        since=(2, 11),
    ),
    Private(
        "torch._prims_common.is_non_overlapping_and_dense",
        "the earlier name of is_non_overlapping_and_dense_or_false",
        until=(2, 10),
    ),
    # -- the build, the host and the dispatcher, as the rules ask them ----------------
    Private(
        "torch._C.DispatchKey",
        "a dispatcher slot: the CPU kernel a composite op follows (composite rules), the "
        "composite kernel linalg_pinv runs through (spectral rules)",
    ),
    Private(
        "torch._C.DispatchKeySet",
        "the set of one dispatcher slot a kernel is looked up by (composite rules)",
    ),
    Private(
        "torch._C._get_nnpack_enabled",
        "whether NNPACK convolutions are on (torch.backends.nnpack has no public getter): "
        "the CPU convolution's backend (conv rules)",
    ),
    *(
        Private(f"torch.cpu._is_{isa}_supported", "the host's ISA level as oneDNN finds it (CPU profiles)")
        for isa in ("amx_tile", "avx512_bf16", "avx512", "avx2")
    ),
    Private(
        "torch._inductor.runtime.cache_dir_utils.default_cache_dir",
        "inductor's cache directory, beside which each capped CPU level gets one of its own (CPU profiles)",
    ),
    *(
        Private(
            f"torch._subclasses.fake_tensor.FakeTensor.{name}",
            "what the model's code reads of a fake cuda tensor: cuda:0 (gpu_view.py; "
            "compiled_cuda's remove_no_ops too, for one of inductor's passes)",
            replaced=True,
            thread_scoped=True,
        )
        for name in ("device", "is_cuda", "get_device")
    ),
    *(
        Private(
            path,
            "what the model's code reads of the GPU on the tracing thread: the profile's "
            "answer (gpu_view.py; get_device_properties and get_device_capability also what "
            "inductor reads while it compiles for the fake cuda device: inductor_device.py)",
            replaced=True,
            thread_scoped=True,
        )
        for path in (
            "torch.cuda.is_available",
            "torch.cuda.device_count",
            "torch.cuda.current_device",
            "torch.cuda.get_device_capability",
            "torch.cuda.get_device_properties",
            "torch.cuda.get_device_name",
            "torch.cuda.is_bf16_supported",
            "torch.backends.cuda.is_built",
            "torch.backends.cuda.is_flash_attention_available",
            "torch.backends.cudnn.is_available",
        )
    ),
    Private(
        "torch.cuda.amp.common.amp_definitely_not_available",
        "torch.autocast('cuda') and GradScaler('cuda') enter enabled on the tracing thread, "
        "as on a GPU (gpu_view.autocast_opens_cuda_regions)",
        replaced=True,
        thread_scoped=True,
    ),
    # torch's own decisions by a device's kernels (gpu_view.torch_decides_as_on_the_gpu)
    *(
        Private(
            f"torch.{home}.{helper}",
            f"torch's list of the device types with {kind} kernels, as torch.{home} binds it: "
            "on the tracing thread the trace's meta device reads as cuda in it",
            replaced=True,
            thread_scoped=True,
        )
        for home, helper, kind in (
            ("utils._foreach_utils", "_get_foreach_kernels_supported_devices", "foreach"),
            ("utils._foreach_utils", "_get_fused_kernels_supported_devices", "fused optimizer"),
            ("optim.optimizer", "_get_foreach_kernels_supported_devices", "foreach"),
            ("optim.optimizer", "_get_fused_kernels_supported_devices", "fused optimizer"),
            ("optim.optimizer", "_get_capturable_supported_devices", "capturable optimizer"),
            ("optim.swa_utils", "_get_foreach_kernels_supported_devices", "foreach"),
            *(
                (f"optim.{name}", "_get_capturable_supported_devices", "capturable optimizer")
                for name in ("adadelta", "adam", "adamax", "asgd", "nadam", "radam", "rmsprop", "rprop")
            ),
        )
    ),
    *(
        Private(
            f"torch.{home}._foreach_supported_types",
            f"the tensor types torch.{home}'s foreach decisions take (type(t) in it): on the "
            "tracing thread the trace's stand-ins count as the tensors they stand for",
            replaced=True,
            thread_scoped=True,
        )
        for home in ("optim.optimizer", "utils._foreach_utils")
    ),
    # -- the fake cuda device's router (cuda/router.py) --------------------------------
    *(
        Private(
            f"torch._C.{home}",
            f"the C bindings of {what}: the torch functions the cuda router and autocast's "
            "table of ops know an op by",
        )
        for home, what in (
            ("_VariableFunctions", "torch's functions"),
            ("_nn", "torch.nn.functional's"),
            ("_linalg", "torch.linalg's"),
            ("TensorBase", "the tensor methods"),
        )
    ),
    Private(
        "torch.amp.autocast_mode._enter_autocast",
        "how torch.autocast enters a region inside a traced program: the router records it",
    ),
    Private(
        "torch.amp.autocast_mode._exit_autocast",
        "how torch.autocast leaves a region inside a traced program: the router records it",
    ),
    Private(
        "torch.overrides._get_current_function_mode_stack",
        "whether the router is on the torch-function mode stack (autocast's entry seen twice)",
    ),
    Private(
        "torch._C._get_sdp_priority_order",
        "the order in which scaled_dot_product_attention tries its backends (no public getter)",
    ),
    # -- torch-function modes --------------------------------------------------------
    Private(
        "torch.overrides.redispatch_function",
        "runs a Python-level torch function's body with a routing mode active (device routers); "
        "earlier releases run a copy of the body whose own check answers no",
        since=(2, 13),
    ),
    # -- parallel (DDP, FSDP2, DTensor) -----------------------------------------------
    Private(
        "torch.testing._internal.distributed.fake_pg.FakeStore",
        "the store of the fake process group the estimate's ranks join (parallel.py)",
    ),
    Private(
        "torch.nn.parallel.distributed._verify_param_shape_across_processes",
        "DDP reads every rank's parameter shapes as data, which fake tensors have none of: "
        "skipped under the fake process group",
        replaced=True,
    ),
    Private(
        "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached",
        "DTensor runs each op on fake tensors of the global shapes to derive its output's: "
        "run out of the tracker's sight (a rank allocates nothing for it)",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._validate_no_meta_params",
        "FSDP2 refuses parameters on meta, where the fake cuda device traces: lifted for the trace",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage",
        "FSDP2 frees an unsharded parameter with storage.resize_(0), which no dispatch mode sees",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage",
        "FSDP2 makes an unsharded parameter again with storage.resize_(nbytes), unseen as its free",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group.alloc_storage",
        "the same function as _fsdp_param.alloc_storage, imported by name into the group's module",
        replaced=True,
    ),
    Private(
        "torch.meta",
        "the device module torch.distributed asks the mesh's device type for (getattr(torch, "
        "type)): torch has none for meta, where the fake cuda device traces; added for a "
        "parallel= trace on it (parallel._MetaDeviceHandle)",
        replaced=True,
        added=True,
    ),
    *(
        Private(
            f"torch.distributed{home}.{name}",
            f"{name}, as Python code calls it from torch.distributed{home}: measure(parallel=...) "
            "runs each to its end where it is called, its tensors let go of by gloo's thread "
            "(distributed.collectives_completed_here)",
            since=(2, 13) if name in ("all_gather_single", "reduce_scatter_single") else None,
            replaced=True,
        )
        for home in ("", ".distributed_c10d")
        for name in (
            "all_gather",
            "all_gather_into_tensor",
            "all_gather_single",
            "all_reduce",
            "all_to_all_single",
            "broadcast",
            "reduce_scatter",
            "reduce_scatter_single",
            "reduce_scatter_tensor",
            "_all_gather_base",
            "_reduce_scatter_base",
        )
    ),
    Private(
        "torch._C._distributed_c10d._create_work_from_future",
        "a completed work item, returned by a collective that measure(parallel=...) ran to its end",
    ),
    Private(
        "torch.autograd.backward",
        "a step function's backward begins where it is called (Tensor.backward calls it by "
        "this name): public, replaced while a step function runs",
        replaced=True,
    ),
    Private(
        "torch.autograd.grad",
        "a step function's backward begins where it is called: public, replaced while a step "
        "function runs",
        replaced=True,
    ),
    Private(
        "torch.distributed.distributed_c10d.ProcessGroupGloo",
        "measure(parallel=...)'s ranks make their gloo groups with one worker thread (works run "
        "in order, each let go of before the next starts)",
        replaced=True,
    ),
    Private(
        "torch._C._distributed_c10d.Reducer._rebuild_buckets",
        "DDP rebuilds its buckets in a loop's second step, writing the new order into integer "
        "tensors that must hold data: they are made real while it runs",
        replaced=True,
    ),
    Private(
        "torch.utils._python_dispatch._disable_current_modes",
        "DTensor's sharding propagation runs with the tracker's modes off",
    ),
    # -- core: the tracer, the trace, the step, measure (tracker.py, trace.py, values.py,
    # -- rules.py, rng_states.py, routing.py, step.py, containers.py, request.py, measuring.py)
    Private(
        "torch._subclasses.fake_tensor.FakeTensor",
        "the fake tensors every traced value is (isinstance checks, stand-ins made "
        "without a dispatch: trace.fake_empty)",
    ),
    Private(
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "the dispatch mode under the tracker that runs every op on fake tensors",
    ),
    Private(
        "torch._subclasses.fake_tensor.DataDependentOutputException",
        "what a fake tensor raises where only values answer (item(), nonzero sizes): "
        "the op is listed in unsupported",
    ),
    Private(
        "torch._subclasses.fake_tensor.DynamicOutputShapeException",
        "what a fake tensor raises for an output shape that depends on values: "
        "the op is listed in unsupported",
    ),
    Private(
        "torch._subclasses.fake_tensor.UnsupportedOperatorException",
        "what a fake tensor raises for an op it cannot run: the op is listed in unsupported",
    ),
    Private(
        "torch._subclasses.fake_tensor.UnsupportedFakeTensorException",
        "what a fake tensor raises for an argument it cannot fake: the op is listed in unsupported",
    ),
    Private(
        "torch._subclasses.fake_tensor.UnsupportedMutationAliasingException",
        "what a fake tensor raises for a custom op's undeclared aliasing: the op is "
        "listed in unsupported",
    ),
    Private(
        "torch.utils._python_dispatch.TorchDispatchMode",
        "the base class of the tracker, the dispatch mode that records every storage",
    ),
    Private(
        "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
        "whether the trace's modes are on the stack where dynamo popped them (trace._visible)",
    ),
    Private(
        "torch.utils._mode_utils.no_dispatch",
        "makes a stand-in's meta tensor without the trip through the fake mode (trace.fake_empty)",
    ),
    Private(
        "torch._C._TorchDispatchModeKey.FAKE",
        "the key of the fake mode in the dispatch mode stack (tracker, rng_states)",
    ),
    Private(
        "torch._C._get_dispatch_mode",
        "whether a fake mode is active (rng_states: dynamo saves the real RNG state)",
    ),
    Private(
        "torch._C._set_dispatch_mode",
        "puts the fake mode back after the tracker called its dispatch directly",
    ),
    Private(
        "torch._C._unset_dispatch_mode",
        "takes the fake mode off the stack while the tracker calls its dispatch directly, "
        "as the C++ dispatcher does",
    ),
    Private(
        "torch._C._len_torch_dispatch_stack",
        "whether the fake mode alone is under the tracker (its dispatch is then called directly)",
    ),
    Private(
        "torch._C._len_torch_function_stack",
        "the router's place on the torch-function mode stack (it steps aside for dynamo)",
    ),
    Private(
        "torch._C._get_function_stack_at",
        "whether the top torch-function mode is the router (it steps aside for dynamo)",
    ),
    Private(
        "torch._C._pop_torch_function_stack",
        "takes the router off the torch-function mode stack before dynamo traces an optimizer step",
    ),
    Private(
        "torch._C._push_on_torch_function_stack",
        "puts the router back on the torch-function mode stack",
    ),
    Private(
        "torch._C.DisableTorchFunction",
        "runs the package's own hooks and bookkeeping without the torch-function modes "
        "(a device router would see their tensor queries)",
    ),
    Private(
        "torch._C._DisableTorchDispatch",
        "reads a real tensor's values without the trace's dispatch modes (known values)",
    ),
    Private(
        "torch._C._current_autograd_node",
        "the backward node whose formula is running (backward attribution, replaced formulas)",
    ),
    Private(
        "torch._C._storage_Use_Count",
        "how many references hold a storage (whether autograd's input buffer alone holds "
        "a gradient, accumulated in place)",
    ),
    Private(
        "torch._C._autograd.SavedTensor",
        "a backward node's saved tensor, read raw to find the storage it keeps alive",
    ),
    Private(
        "torch._C._dispatch_has_kernel_for_dispatch_key",
        "whether an op is a composite (CompositeImplicitAutograd) whose ops are charged "
        "themselves (tracker, measure's kernel attribution)",
    ),
    Private(
        "torch._C._dynamo.eval_frame.set_eval_frame",
        "turns dynamo's frame callback off while the tracker records (its own frames)",
    ),
    Private(
        "torch._dynamo.decorators.skip",
        "has dynamo's frame callback pass over the tracker's __torch_dispatch__",
    ),
    Private(
        "torch.nn.Module._compiled_call_impl",
        "what module.compile() sets: a model holding compiled modules (request.py)",
    ),
    Private(
        "torch._ops.OpOverload",
        "the type of an aten overload: the key of the rule registries and of known values",
    ),
    Private(
        "torch._ops.OpOverloadPacket",
        "the type of an aten op's packet: a rule registered for every overload",
    ),
    Private(
        "torch.utils._pytree.tree_flatten",
        "one level of a container the user passes (containers.py)",
    ),
    Private(
        "torch.utils._pytree.tree_unflatten",
        "a container the user passes, rebuilt with stand-ins (containers.py)",
    ),
    Private(
        "torch.utils._pytree.tree_leaves",
        "the tensors of a module's arguments and output (step.py's module hooks)",
    ),
    Private(
        "torch.utils.checkpoint._recomputation_hook",
        "non-reentrant checkpointing's recomputation re-enters the device router "
        "(routing.routed_recomputation)",
        replaced=True,
    ),
    Private(
        "torch.get_rng_state",
        "a checkpointed region's copy of the CPU RNG state, charged as a fake tensor of its size "
        "(rng_states.charged_rng_states)",
        replaced=True,
    ),
    Private(
        "torch.set_rng_state",
        "setting a fake RNG state copy does nothing (rng_states.charged_rng_states)",
        replaced=True,
    ),
    Private(
        "torch.random.get_rng_state",
        "as torch.get_rng_state, by the name torch.utils.checkpoint calls",
        replaced=True,
    ),
    Private(
        "torch.random.set_rng_state",
        "as torch.set_rng_state, by the name torch.utils.checkpoint calls",
        replaced=True,
    ),
    Private(
        "torch.nn.parameter._ParameterMeta.__instancecheck__",
        "isinstance(t, nn.Parameter) holds for a tensor whose _is_param is set: stand-in "
        "parameters are marked so, without Parameter's detach() (trace._fake_parameter)",
    ),
    # read by name on each tensor or storage (the dispatch's hot path: written as
    # attributes there, checked here)
    Private(
        "torch.Tensor._base",
        "the base a view shares its storage with (in-place writes to views, the tracker)",
    ),
    Private(
        "torch.Tensor._is_view",
        "whether a fake tensor is a view (in-place writes to views, the tracker)",
    ),
    Private(
        "torch.UntypedStorage._cdata",
        "a storage's identity, the key of every storage the tracker and measure follow",
    ),
    # measure(device="cpu") reads the profiler's event tree (torch/csrc/profiler/python/init.cpp)
    Private(
        "torch._C._autograd._ProfilerResult.experimental_event_tree",
        "the profiler's event tree measure(device='cpu') reads its allocations from",
    ),
    Private(
        "torch._C._profiler._ExtraFields_Allocation",
        "an allocator event of the profiler (measure(device='cpu'))",
    ),
    Private(
        "torch._C._profiler._ExtraFields_Allocation.ptr",
        "the address an allocator event allocates or frees (read on each event)",
    ),
    Private(
        "torch._C._profiler._ExtraFields_Allocation.alloc_size",
        "the bytes of an allocator event, negative for a free (read on each event)",
    ),
    Private(
        "torch._C._profiler._ProfilerEvent.extra_fields",
        "an event's kind and fields (allocation, op) (read on each event)",
    ),
    Private(
        "torch._C._profiler._ProfilerEvent.children",
        "the events inside an event (read on each event)",
    ),
    Private(
        "torch._C._profiler._ProfilerEvent.parent",
        "the op an allocator event happened in (read on each event)",
    ),
    Private(
        "torch._C._profiler._ProfilerEvent.name",
        "an op event's name: measure's marks, compiled regions (read on each event)",
    ),
    Private(
        "torch._C._profiler._ProfilerEvent.start_tid",
        "the thread of an event: the step's own (read on each event)",
    ),
    Private(
        "torch._C._profiler._ProfilerEvent.start_time_ns",
        "the order of events (read on each event)",
    ),
    Private(
        "torch._C._profiler._ProfilerEvent.end_time_ns",
        "when an op event ends (read on each event)",
    ),
    Private(
        "torch._C._cuda_clearCublasWorkspaces",
        "measure(device='cuda') starts with no cuBLAS workspace, as the estimate does "
        "(a CUDA build's binding only)",
        cuda_only=True,
    ),
    # -- compiled models (torch.compile): COMPILED, below ------------------------------
    *COMPILED_ENTRIES,
)


def entry(path: str) -> Private:
    """The table's entry for ``path`` (a :class:`KeyError` names a path missing from it)."""
    try:
        return PRIVATE[path]
    except KeyError:
        raise KeyError(f"{path} is not in pytest_torchmem.engine.torch_private.PRIVATE: add it there") from None


def _resolve(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            value = getattr(value, name)
        return value
    raise ImportError(path)


_resolved: dict[str, Any] = {}


def _missing(path: str, cause: BaseException) -> TorchPrivateError:
    import torch

    found = entry(path)
    releases = _releases(found)
    detail = " ".join(str(cause).split())  # one line, whatever the cause wrote
    return TorchPrivateError(
        f"torch {torch.__version__} has no {path} ({found.why}; expected in torch {releases}; "
        f"{type(cause).__name__}: {detail}); pytest-torchmem supports torch {supported_range()}"
    )


def _releases(found: Private) -> str:
    """The releases an entry names, in words: ``"2.12 on"``, ``"2.10 to 2.11"``, ``"2.10 to 2.15"``."""
    first, last = SUPPORTED
    since, until = found.since or first, found.until or last
    words = f"{since[0]}.{since[1]} to {until[0]}.{until[1]}"
    if found.until is None and found.since is not None:
        words = f"{since[0]}.{since[1]} on"
    return words + (", CUDA builds" if found.cuda_only else "")


def private(path: str) -> Any:
    """The private torch object at ``path``, an entry of :data:`PRIVATE`.

    Raises :class:`TorchPrivateError` where the running torch does not have it.
    """
    try:
        return _resolved[path]
    except KeyError:
        pass
    entry(path)
    try:
        value = _resolve(path)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    _resolved[path] = value
    return value


def private_name(path: str) -> str:
    """The attribute name that ends ``path`` (an entry of :data:`PRIVATE`), for
    reading it on instances (``getattr(module, private_name(...))``), once the
    running torch is checked to have it (on the class)."""
    private(path)
    return path.rpartition(".")[2]


def private_any(*paths: str) -> Any:
    """The first of ``paths`` (entries of :data:`PRIVATE`: one name as releases
    spell it) that the running torch has, chosen once."""
    try:
        return _resolved[paths]  # type: ignore[index]
    except KeyError:
        pass
    found = next((path for path in paths[:-1] if present(path)), paths[-1])
    _resolved[paths] = value = private(found)  # type: ignore[index]
    return value


def present(path: str) -> bool:
    """Whether the running torch has the private name at ``path`` (an entry of :data:`PRIVATE`)."""
    try:
        private(path)
    except TorchPrivateError:
        return False
    return True


def private_op(name: str) -> Any:
    """The aten overload ``name`` (``"cholesky.default"``) where the running torch
    has it, else None: for rules of ops that some releases of the window removed
    or added (a rule registered for None is skipped)."""
    import torch

    packet, _, overload = name.partition(".")
    try:
        return getattr(getattr(torch.ops.aten, packet), overload or "default")
    except AttributeError:
        return None


# -- run-time replacements: the one mechanism ---------------------------------------------

#: The tabled paths replaced now, in the order they were entered (by any thread).
_in_effect: list[str] = []


def in_effect() -> tuple[str, ...]:
    """The tabled paths replaced now (:func:`replacing`, :func:`appending`,
    :func:`replacing_item`), in the order they were entered."""
    return tuple(_in_effect)


@contextmanager
def _held(path: str) -> Iterator[None]:
    _in_effect.append(path)
    try:
        yield
    finally:
        for i in range(len(_in_effect) - 1, -1, -1):
            if _in_effect[i] == path:
                del _in_effect[i]
                break


def _replaceable(path: str) -> Private:
    found = entry(path)
    if not found.replaced:
        raise ValueError(f"{path} is not marked replaced=True in PRIVATE")
    return found


@functools.cache
def _config_option(path: str) -> tuple[Any, str] | None:
    """``(config module, option)`` where ``path`` names an option of a torch config module
    (``torch._inductor.config.cpp.simdlen``: ``torch._inductor.config``, ``"cpp.simdlen"``)."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        # (torch.utils._config_module's modules: options kept in _config, set through patch)
        if isinstance(getattr(module, "_config", None), dict) and callable(getattr(module, "patch", None)):
            return module, ".".join(parts[split:])
        return None
    return None


@contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` is ``value`` for the block; yields what ``owner.name`` was (None:
    nothing), put back however the block ends: a class's own attribute (a descriptor,
    a ``staticmethod``) as it was, one it inherits or lacks deleted again.

    The core of :func:`replacing`; called directly only for an attribute outside
    torch (a library's class the traced model uses), which the table does not hold."""
    original = getattr(owner, name, None)
    had_own = name in getattr(owner, "__dict__", {})
    own = owner.__dict__[name] if had_own else None
    setattr(owner, name, value)
    try:
        yield original
    finally:
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


@contextmanager
def replacing(path: str, value: Any) -> Iterator[Any]:
    """Replace the torch attribute at ``path`` (an entry marked ``replaced``) with ``value``
    for the block, yielding the original; it is put back however the block ends.

    ``path`` names a module's global or a class's attribute (:func:`swapped`); an option
    of a torch config module (``torch._inductor.config.force_disable_caches``), set
    through the config's own ``patch``, which puts its state back as it was; or, for an
    entry marked ``added``, an attribute torch lacks, added for the block (None yielded).
    """
    found = _replaceable(path)
    config = _config_option(path)
    if config is not None:
        module, option = config
        try:
            original = functools.reduce(getattr, option.split("."), module)
        except AttributeError as exc:
            raise _missing(path, exc) from None
        with module.patch(option, value), _held(path):
            yield original
        return
    owner_path, _, name = path.rpartition(".")
    try:
        # what is there now (not the value private() keeps): a replacement
        # nested in another's wraps and restores the one it found
        owner = _resolve(owner_path)
        if not found.added:
            getattr(owner, name)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    if found.added and hasattr(owner, name):
        raise ValueError(f"{path} is marked added=True in PRIVATE, but this torch has it: see its entry")
    with swapped(owner, name, value) as original, _held(path):
        yield original


@contextmanager
def appending(path: str, item: Any) -> Iterator[None]:
    """Add ``item`` to the private torch list at ``path`` for the block; it is taken out
    however the block ends. The list object stays the same: modules that bound it by
    name, or add to it later in the block (``torch.distributed.tensor`` adds ``DTensor``
    to the foreach type lists when first imported), keep theirs."""
    _replaceable(path)
    try:
        found = _resolve(path)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    if not isinstance(found, list):
        raise TypeError(f"{path} is a {type(found).__name__}, not a list")
    found.append(item)
    try:
        with _held(path):
            yield
    finally:
        for i in range(len(found) - 1, -1, -1):
            if found[i] is item:
                del found[i]
                break


@contextmanager
def replacing_item(path: str, key: Any, value: Any, *, within: Any = None) -> Iterator[Any]:
    """Set ``key`` of the private torch dict at ``path`` to ``value`` for the block, yielding
    what it held (None: nothing); it is put back, or taken out again, however the block ends.

    ``within``: the dict is that object's attribute of the name ``path`` ends with, for a
    dict every instance of a torch class holds (the entry's path names one instance)."""
    _replaceable(path)
    try:
        container = getattr(within, path.rpartition(".")[2]) if within is not None else _resolve(path)
    except (ImportError, AttributeError) as exc:
        raise _missing(path, exc) from None
    if not isinstance(container, dict):
        raise TypeError(f"{path} is a {type(container).__name__}, not a dict")
    had = key in container
    before = container.get(key)
    container[key] = value
    try:
        with _held(path):
            yield before
    finally:
        if had:
            container[key] = before
        else:
            container.pop(key, None)


@contextmanager
def on_this_thread(path: str, answer: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Replace the function at ``path`` (a ``thread_scoped`` entry) for the block: on this
    thread (the tracing thread) it answers ``answer(...)``, on every other one as the
    function it replaced (yielded), which it is put back as however the block ends."""
    thread = threading.get_ident()
    real: list[Callable[..., Any]] = []

    def scoped(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            return answer(*args, **kwargs)
        return real[0](*args, **kwargs)

    if not entry(path).thread_scoped:
        raise ValueError(f"{path} is not marked thread_scoped=True in PRIVATE")
    with replacing(path, scoped) as original:
        real.append(original)
        functools.update_wrapper(scoped, original)
        yield original


def window() -> tuple[Release, Release]:
    """The supported window, first and last minor release."""
    return SUPPORTED
