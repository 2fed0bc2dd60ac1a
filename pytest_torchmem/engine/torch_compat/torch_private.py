"""Every private torch name the engine reads or replaces, in one table.

torch promises nothing of its private names (``torch._prims_common``,
``torch._inductor``, ``torch._C._...``): a minor release moves, renames or
removes them. The engine reaches them through this module only, so that each
one is written down once, with why it is used and in which releases it exists,
and is checked against the running torch when first used:

- :func:`private` resolves a dotted path (``"torch._prims_common.suggest_memory_format"``);
- :func:`private_op` gives an aten overload that only some releases have (None elsewhere).

Every run-time replacement of a torch attribute is an entry of the table marked
``replaced`` (what, why, which releases; ``thread_scoped`` where only the tracing
thread may see it, ``added`` where torch has no such attribute), made through one
mechanism, :mod:`pytest_torchmem.engine.torch_compat.torch_replacing`.

A path missing from the running torch raises :class:`TorchPrivateError`, one
line that names it, what it served and the supported window, never an
``AttributeError`` from deep inside a rule. ``tests/test_torch_private.py``
resolves every entry on the running torch, and CI runs it on every release of
the window.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

from pytest_torchmem.engine.torch_compat.private_name import Private, Release, table
from pytest_torchmem.engine.torch_compat.torch_private_compiled import (
    COMPILED_ENTRIES,
    COMPILED_WHERE_PRESENT,
)
from pytest_torchmem.engine.torch_compat.torch_release import (
    SUPPORTED,
    TorchReleaseError,
    supported_range,
)

#: The caching allocator's statistics as ``torch.cuda`` (and ``torch.cuda.memory``) and
#: ``torch.accelerator`` (and ``torch.accelerator.memory``) name them.
_STATISTICS: Final = (
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
)
_CUDA_MEMORY: Final = (
    *_STATISTICS,
    "mem_get_info",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "memory_cached",
    "max_memory_cached",
)
_ACCELERATOR_MEMORY: Final = (*_STATISTICS, "get_memory_info")

__all__ = [
    "COLLECTIVES",
    "COMPILED_COLLECTIVES",
    "P2P_FUNCTIONS",
    "PRIVATE",
    "Private",
    "TorchPrivateError",
    "present",
    "private",
    "private_any",
    "private_name",
    "private_op",
]

class TorchPrivateError(TorchReleaseError):
    """A private torch name the engine needs is not in the running torch."""


#: The collectives of ``torch.distributed`` that Python code (FSDP2, user code) calls,
#: each replaced in ``torch.distributed`` and ``torch.distributed.distributed_c10d`` by
#: measure(parallel=...) (distributed.collectives_completed_here).
COLLECTIVES: Final = (
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

#: The functional collectives inductor's programs issue (``comm_lowering.py``: its
#: lowerings call each by its ``default`` overload, a name read as the program runs),
#: each replaced there by measure(parallel=...) (distributed.collectives_completed_here).
COMPILED_COLLECTIVES: Final = (
    "all_reduce_",
    "all_reduce_coalesced_",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_out",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_out",
    "all_to_all_single",
    "broadcast_",
)

#: The point-to-point functions of ``torch.distributed`` a pipeline's stages call, each
#: delivered between the threads of a pipeline's ranks (tracing/pipeline_group.py).
P2P_FUNCTIONS: Final = (
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
)

#: The table: private path -> its entry.
PRIVATE: Final = table(
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
            "torch.cuda.set_device",
            "torch.cuda.synchronize",
        )
    ),
    *(
        Private(
            path,
            "torch.random.fork_rng saves and restores the GPU generator's state (a pipeline "
            "stage's metadata inference): a host tensor on the tracing thread, whoever asks "
            "(gpu_view)",
            replaced=True,
            thread_scoped=True,
        )
        for path in ("torch.cuda.get_rng_state", "torch.cuda.set_rng_state")
    ),
    Private(
        "torch._subclasses.fake_tensor.FakeTensor.record_stream",
        "the program records a fake cuda tensor on one of its streams: nothing to do, the "
        "block's allocated bytes go when the tensor does (gpu_view.py, streams.py)",
        replaced=True,
        thread_scoped=True,
    ),
    *(
        Private(
            path,
            "what the program asks of the current accelerator on the tracing thread: the "
            "profile's GPU (gpu_view.py)",
            replaced=True,
            thread_scoped=True,
        )
        for path in (
            "torch.get_device_module",
            "torch.cuda.is_current_stream_capturing",
            *(
                f"torch.accelerator.{name}"
                for name in (
                    "is_available",
                    "current_accelerator",
                    "device_count",
                    "current_device_index",
                    "current_device_idx",
                    "set_device_index",
                    "set_device_idx",
                    "synchronize",
                    "get_device_capability",
                )
            ),
        )
    ),
    *(
        Private(
            path,
            "the program's CUDA streams on the tracing thread: the trace's, each with an "
            "allocator pool of its own (streams.py)",
            replaced=True,
            thread_scoped=True,
        )
        for path in (
            "torch.cuda.current_stream",
            "torch.cuda.default_stream",
            "torch.cuda.set_stream",
            "torch.cuda.stream",
            "torch.accelerator.current_stream",
            "torch.accelerator.set_stream",
        )
    ),
    *(
        Private(
            path,
            "the stream and event classes the program makes and checks against on the "
            "tracing thread: the trace's (streams.py)",
            replaced=True,
            by_reader=True,
        )
        for path in (
            "torch.cuda.Stream",
            "torch.cuda.Event",
            "torch.cuda.StreamContext",
            "torch.Stream",
            "torch.Event",
            "torch.accelerator.device_index",
        )
    ),
    *(
        Private(
            f"{home}.{name}",
            "the caching allocator's statistics the program reads on the tracing thread: the "
            "trace's figures so far (memory_stats.py)",
            replaced=True,
            thread_scoped=True,
        )
        for home, names in (
            ("torch.cuda", _CUDA_MEMORY),
            ("torch.cuda.memory", _CUDA_MEMORY),
            ("torch.accelerator", _ACCELERATOR_MEMORY),
            ("torch.accelerator.memory", _ACCELERATOR_MEMORY),
        )
        for name in names
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
        "torch._C._AutoDispatchBelowAutograd",
        "dispatch below autograd: the cuda router runs _fused_rms_norm as the CUDA kernel, "
        "not as its CompositeImplicitAutograd decomposition (no meta kernel), its autograd "
        "node its own (cuda/rms_norm.py)",
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
        "the store of the fake process group the estimate's ranks join (parallel/mesh.py)",
    ),
    Private(
        "torch.nn.parallel.distributed._verify_param_shape_across_processes",
        "DDP reads every rank's parameter shapes as data, which fake tensors have none of: "
        "skipped under the fake process group",
        replaced=True,
    ),
    Private(
        "torch.distributed.tensor.experimental._context_parallel._attention._disable_context_parallel_dispatcher_impl",
        "context_parallel() of 2.10 to 2.12 leaves SDPA patched for ring attention when its "
        "block raises (no try/finally around its yield): a train context that raised in the "
        "trace is undone with torch's own undoing, so the process's SDPA is as it was",
    ),
    Private(
        "torch.distributed.distributed_c10d._resolve_process_group",
        "a functional collective names its group: the rank's index in it and its size, to "
        "answer an exchange of integer values (expert parallel's token counts)",
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.to_accumulated_grad_if_needed",
        "2.10 to 2.14 move a unit's gradients off its gathered parameters after each backward "
        "that does not reduce them (a pipeline's micro-batches), into a gradient of the reduce "
        "dtype, where that differs: a later micro-batch's backward finds none, and its blocks "
        "may be replayed (2.15 keeps them there, cast up in place)",
        until=(2, 14),
    ),
    Private(
        "torch.distributed.tensor._api._ToTorchTensor",
        "DTensor's to_local() as an autograd function: a block whose graph holds it (tensor "
        "parallel inside an FSDP2 unit) may be replayed, its backward recorded with the block's",
    ),
    Private(
        "torch.distributed.tensor._api._FromTorchTensor",
        "DTensor.from_local() as an autograd function (block_replay.py, as _ToTorchTensor)",
    ),
    Private(
        "torch.distributed.tensor._redistribute.Redistribute",
        "DTensor.redistribute() as an autograd function (block_replay.py, as _ToTorchTensor)",
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
        thread_scoped=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage",
        "FSDP2 makes an unsharded parameter again with storage.resize_(nbytes), unseen as its free",
        replaced=True,
        thread_scoped=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.__init__",
        "where FSDP2 takes a parameter with its offload policy: estimate(parallel=...) refuses "
        "CPU offload there in one line (host memory is not counted apart), before FSDP2 pins "
        "a shard or checks the stand-ins' device",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fully_shard._get_post_forward_mesh_info",
        "FSDP2 with reshard_after_forward=k makes a mesh of k-rank groups from its mesh's rank "
        "tensor (fully_shard, set_reshard_after_forward): run with the fake mode off, as every "
        "mesh the trace makes (parallel._fake_tensor_checks_skipped)",
        replaced=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty",
        "FSDP2 cuts each parameter into one view per rank to keep its own: made as read for "
        "the trace (parallel._Chunks), the same views without the other ranks' tens of thousands",
        replaced=True,
        thread_scoped=True,
    ),
    Private(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group.alloc_storage",
        "the same function as _fsdp_param.alloc_storage, imported by name into the group's module",
        replaced=True,
        thread_scoped=True,
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
        for name in COLLECTIVES
    ),
    *(
        Private(
            f"torch.ops._c10d_functional.{name}.default",
            f"{name}, as inductor's programs issue it (the name is read as the program runs): "
            "measure(parallel=...) runs it to its end where it is issued, its tensors let go of "
            "by gloo's thread (distributed.collectives_completed_here)",
            replaced=True,
        )
        for name in COMPILED_COLLECTIVES
    ),
    Private(
        "torch.ops._c10d_functional.wait_tensor.default",
        "what inductor's programs call to wait for a functional collective (the name is read "
        "as the program runs): measure(parallel=...) waits there for gloo's thread to let go "
        "of the buffer too (distributed.collectives_completed_here)",
        replaced=True,
    ),
    Private(
        "torch.distributed._functional_collectives._maybe_wrap_tensor",
        "where every functional collective (DTensor's, loss_parallel's all-reduces) wraps the "
        "tensor its op made: measure(parallel=...) waits for it there, and for gloo's thread to "
        "let go of it (distributed.collectives_completed_here)",
        replaced=True,
    ),
    Private(
        "torch.distributed._functional_collectives.wait_tensor",
        "a functional collective's wait, made where measure(parallel=...) runs it to its end",
    ),
    *(
        Private(
            f"torch.distributed{home}.{name}",
            f"{name}, as Python code calls it from torch.distributed{home}: the estimate of a "
            "pipeline rank delivers it between the threads of the pipeline's ranks "
            "(tracing/pipeline_group.py)",
            replaced=True,
        )
        for home in ("", ".distributed_c10d")
        for name in P2P_FUNCTIONS
    ),
    Private(
        "torch.distributed.pipelining.schedules._PipelineSchedule",
        "the base of every pipelining schedule: what Parallel(schedule=...) accepts (parallel/pipeline.py)",
    ),
    Private(
        "torch.distributed.pipelining.stage._PipelineStageBase",
        "the base of every pipeline stage: what apply returns under Parallel(schedule=...) "
        "(parallel/pipeline.py)",
    ),
    Private(
        "torch.distributed.device_mesh.DeviceMesh",
        "a device mesh, whose bookkeeping (sub-meshes, the mesh tensor) runs on real tensors",
    ),
    Private(
        "torch.distributed.device_mesh.DeviceMesh.__getitem__",
        "a dimension's sub-mesh (mesh['dp']) in apply, computed from the mesh's real integer "
        "tensors with every mode off (parallel._fake_tensor_checks_skipped)",
        replaced=True,
    ),
    Private(
        "torch.distributed.device_mesh.DeviceMesh.__init__",
        "a mesh made in apply (FSDP2 of tensor-parallel parameters concatenates the meshes), "
        "its coordinates computed from real integer tensors with every mode off",
        replaced=True,
    ),
    Private(
        "torch.distributed.device_mesh.DeviceMesh.mesh",
        "the mesh tensor, computed from the mesh's real integer tensors with every mode off",
        replaced=True,
    ),
    Private(
        "torch.distributed.distributed_c10d._world",
        "the process's process groups: made thread-local while a pipeline's ranks trace on "
        "threads of their own (tracing/pipeline_group.py)",
        replaced=True,
    ),
    Private(
        "torch.distributed.pipelining.stage._PipelineStageBase._output_slot_is_releasable",
        "2.15 releases a stage's sent output once its send completes, but only a plain "
        "torch.Tensor's (type(output) is torch.Tensor): a traced rank's outputs are fake "
        "tensors standing for plain ones, released as theirs are (tracing/pipeline_group.py)",
        since=(2, 15),
        replaced=True,
    ),
    Private(
        "torch.distributed.pipelining.schedules._PipelineSchedule._initialize_pp_stages",
        "a schedule's set-up of its stages (the metadata vote and inference, the receive "
        "buffers), the first step's start: a pipeline rank's peers are traced through it only "
        "(tracing/pipeline_group.py)",
        since=(2, 12),
        replaced=True,
    ),
    Private(
        "torch.distributed.pipelining.schedules.dist",
        "torch.distributed as the schedules call it: while a pipeline's ranks trace, its groups' "
        "backend is not 'fake' (2.14+ skip the stages' metadata vote over a fake group; the "
        "threads deliver it; tracing/pipeline_group.py)",
        replaced=True,
    ),
    Private(
        "torch.nn.parallel.distributed.DistributedDataParallel._inside_ddp_forward",
        "DDP's forward marks its module active in one class attribute: made per thread while "
        "a pipeline's ranks trace on threads (their forwards interleave; tracing/pipeline_group.py)",
        replaced=True,
    ),
    Private(
        "torch.nn.parallel.distributed.DistributedDataParallel._get_active_ddp_module",
        "the DDP module in forward, as dynamo asks for it: the thread's own while a pipeline's "
        "ranks trace on threads (tracing/pipeline_group.py)",
        replaced=True,
    ),
    Private(
        "torch.testing._internal.distributed.multi_threaded_pg.ThreadLocalWorld",
        "a world of process groups of each thread's own, as torch's threaded tests make it "
        "(tracing/pipeline_group.py)",
    ),
    Private(
        "torch._C._distributed_c10d._set_thread_isolation_mode",
        "process groups registered by name per thread (each pipeline rank's thread makes "
        "groups of the same names; tracing/pipeline_group.py)",
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
    *(
        Private(
            f"torch.nn.modules.module.{name}",
            "the hooks every module runs: a loop's forward and backward are replayed only "
            "where none but the trace's own module tracker's are registered (tracing/replay.py)",
        )
        for name in (
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    ),
    *(
        Private(
            f"torch.optim.optimizer.{name}",
            "the hooks every optimizer's step runs: a loop's optimizer step is replayed only "
            "where none are registered (tracing/optimizer_replay.py)",
        )
        for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    ),
    Private(
        "torch._has_compatible_shallow_copy_type",
        "whether a converted fake parameter can take its copy's data in place, as a real one "
        "does in Module._apply (tracing/module_methods.py)",
    ),
    Private(
        "torch.nn.modules.module.Module._apply",
        "a module's .to(), .cuda(), .half(), ... convert its fake parameters in place on the "
        "tracing thread, as real ones are (tracing/module_methods.py)",
        replaced=True,
        thread_scoped=True,
    ),
    Private(
        "torch._tensor.Tensor.__deepcopy__",
        "copy.deepcopy of a fake tensor (a module's, an EMA's copy) is its clone on the tracing "
        "thread (tracing/module_methods.py): public, replaced while a step runs",
        replaced=True,
        thread_scoped=True,
    ),
    *(
        Private(
            f"torch.{owner}.{method}",
            "the modules and optimizers a step function makes (constructed or copied) are its "
            "own; any other it calls that its walk did not reach is refused (user/watching.py): "
            "public, wrapped while a step function runs, always calling the original",
            replaced=True,
        )
        for owner in ("nn.modules.module.Module", "optim.optimizer.Optimizer")
        for method in ("__init__", "__setstate__")
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
    Private(
        "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
        "a wrapper subclass's memory is its inner tensors' storages (layouts.parts: torchao's "
        "optimizer states and float8 tensors)",
    ),
    # -- core: the tracer, the trace, the step, measure (tracker.py, trace.py, values.py,
    # -- rules.py, rng_states.py, routing.py, step/built_in.py, user/containers.py, step/request.py, measuring/runs.py)
    Private(
        "torch._subclasses.fake_tensor.FakeTensor",
        "the fake tensors every traced value is (isinstance checks, stand-ins made "
        "without a dispatch: trace.fake_empty); the program that looks it up by name "
        "finds a class no tensor is an instance of, as in a real run (real_run_view.py)",
        replaced=True,
        by_reader=True,
    ),
    # what the program asks about the trace, answered as a real run (real_run_view.py)
    Private(
        "torch._subclasses.FakeTensor",
        "the program that looks FakeTensor up by name finds a class no tensor is an "
        "instance of, as in a real run (transformers' is_tracing)",
        replaced=True,
        by_reader=True,
    ),
    *(
        Private(
            path,
            "the program's question whether a tensor is fake, or a fake or dispatch mode is "
            "on: the trace's are not, as in a real run",
            replaced=True,
            by_reader=True,
        )
        for path in (
            "torch._subclasses.fake_tensor.is_fake",
            "torch._subclasses.fake_tensor.maybe_get_fake_mode",
            "torch.utils._python_dispatch.is_in_torch_dispatch_mode",
            "torch.utils._python_dispatch._get_current_dispatch_mode",
        )
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
        "torch._subclasses.fake_tensor.FakeTensorDeviceMismatchError",
        "what a fake tensor raises for an op on tensors of two devices: the trace stopped, "
        "its message says which devices as the program saw them (2.10 to 2.12 raise a "
        "RuntimeError, 'Unhandled FakeTensor Device Propagation for <op>, found two "
        "different devices <a>, <b>': torch/_subclasses/fake_tensor.py, 2.12.1 line 1050)",
        since=(2, 13),
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
    *(
        Private(
            f"torch.utils._python_dispatch.{name}",
            "what the trace makes for its own accounting is made below the dispatch modes "
            "the program entered itself (the_program.out_of_the_programs_sight)",
        )
        for name in ("_pop_mode", "_push_mode")
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
        "torch._C._autograd._get_sequence_nr",
        "the sequence number the next autograd node gets: which nodes a block made "
        "(block replay)",
    ),
    Private(
        "torch._C._autograd._top_saved_tensors_default_hooks",
        "the saved-tensor hooks a block's call runs under (a checkpoint or an offloader "
        "the caller put around it): calls under unlike hooks are not replayed alike",
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
        "what module.compile() sets: a model holding compiled modules (step/request.py)",
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
        "one level of a container the user passes (user/containers.py)",
    ),
    Private(
        "torch.utils._pytree.tree_unflatten",
        "a container the user passes, rebuilt with stand-ins (user/containers.py)",
    ),
    Private(
        "torch.utils._pytree.tree_leaves",
        "the tensors of a module's arguments and output (step/built_in.py's module hooks)",
    ),
    Private(
        "torch.utils.checkpoint._recomputation_hook",
        "non-reentrant checkpointing's recomputation re-enters the device router "
        "(routing.routed_unpacking)",
        replaced=True,
    ),
    Private(
        "torch._C._autograd._push_saved_tensors_default_hooks",
        "the program's saved-tensor unpack hooks re-enter the device router in backward "
        "(routing.routed_unpacking: activation offloading's copies back to the GPU)",
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
    *COMPILED_WHERE_PRESENT,
)


def entry(path: str) -> Private:
    """The table's entry for ``path`` (a :class:`KeyError` names a path missing from it)."""
    try:
        return PRIVATE[path]
    except KeyError:
        raise KeyError(f"{path} is not in pytest_torchmem.engine.torch_compat.torch_private.PRIVATE: add it there") from None


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


def window() -> tuple[Release, Release]:
    """The supported window, first and last minor release."""
    return SUPPORTED
