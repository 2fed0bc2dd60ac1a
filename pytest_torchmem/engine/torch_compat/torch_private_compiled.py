"""The private torch names of compiled models: the watch of compiled regions and inductor's program followed.

Entries of :data:`pytest_torchmem.engine.torch_compat.torch_private.PRIVATE`, kept apart as one
list because :mod:`pytest_torchmem.engine.tracing.compiled` checks them together.
"""

from __future__ import annotations

from typing import Final

from pytest_torchmem.engine.torch_compat.private_name import Private

__all__ = ["COMPILED_ENTRIES", "COMPILED_WHERE_PRESENT"]


#: The private names of compiled models (torch.compile): the watch of compiled regions,
#: our dynamo cache regions, and inductor's program followed on fake cpu and cuda tensors.
#: Every one is present wherever a compiled region is followed (see
#: pytest_torchmem.engine.tracing.compiled.following_blocked): one missing lists each
#: compiled region in ``unsupported`` with its name, never an AttributeError mid-compile.
COMPILED_ENTRIES: Final = (
    Private(
        "torch._dynamo.eval_frame._maybe_set_eval_frame",
        "the call by which dynamo's compile_wrapper enters a compiled region: the watch of "
        "compiled regions sees each one there and runs it followed, or eagerly and flagged "
        "(each tracing thread's own: a pipeline's stages are traced on threads of one process)",
        replaced=True,
        thread_scoped=True,
    ),
    Private(
        "torch._dynamo.eval_frame.set_fullgraph_compiled_frame_count",
        "fullgraph=True counts the frames dynamo compiled in a call and refuses a call that "
        "compiled none ('found no compiled frames'): a region the watch runs eagerly on "
        "purpose, flagged, is read back as one (on the thread whose watch ran it)",
        since=(2, 12),
        replaced=True,
        thread_scoped=True,
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
        "out of the by-path cache (each tracing thread's own: a pipeline's stages compile "
        "on threads of one process)",
        replaced=True,
        thread_scoped=True,
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
        "the check replace_random_passes makes of a value: a fake cuda tensor is not meta "
        "there; nor is it to the program on the tracing thread (gpu_view.py)",
        replaced=True,
    ),
    Private(
        "torch._dynamo.variables.tensor.TensorVariable.specialize",
        "dynamo's view of a tensor's device: the fake cuda device's tensors are cuda there",
        replaced=True,
    ),
    Private(
        "torch._dynamo.variables.optimizer.OptimizerVariable._set_capturable",
        "dynamo makes a compiled optimizer step capturable where the parameters are on a "
        "GPU: the fake cuda device's are (their stand-ins are on the trace's meta device)",
        replaced=True,
    ),
    Private(
        "torch._inductor.utils.copy_misaligned_inputs",
        "a compiled program's check of its inputs' alignment when it runs on the GPU: by the "
        "storage offset on the fake cuda device, where a fake tensor has no address",
        replaced=True,
    ),
    Private("torch._inductor.utils.ALIGNMENT", "the alignment copy_misaligned_inputs checks"),
    Private(
        "torch._inductor.utils.clone_preserve_strides",
        "the copy copy_misaligned_inputs makes of a misaligned input",
    ),
    Private(
        "torch.tensor",
        "a tensor made from a Python number while inductor's decompositions run for the fake "
        "cuda device: on the host, where it keeps its value (compiled_cuda.py)",
        replaced=True,
        thread_scoped=True,
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
        "the fake mode of the graph inductor compiles for cuda; to the program it finds "
        "none where the one it finds is the trace's, as in a real run (real_run_view.py)",
        replaced=True,
        by_reader=True,
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


#: The private names of compiled models that only some releases have, where dynamo or
#: inductor moved what the entries of :data:`COMPILED_ENTRIES` reach on the others: used
#: where present, and none of them blocks following where absent.
COMPILED_WHERE_PRESENT: Final = (
    Private(
        "torch._dynamo.variables.optimizer.OptimizerVariable._safe_to_set_capturable",
        "where dynamo asks whether a compiled optimizer step's parameters are on a GPU "
        "from 2.15 (per parameter group; _set_capturable before)",
        since=(2, 15),
        replaced=True,
    ),
    Private(
        "torch._dynamo.variables.optimizer.OptimizerVariable._init_group",
        "dynamo's handler of an optimizer's _init_group, which it calls eagerly while it "
        "compiles the step: run with the trace's modes visible (compiled_program.py)",
        since=(2, 15),
    ),
    Private(
        "torch._dynamo.variables.optimizer.OptimizerVariable.tp_methods",
        "the table of handlers by name where dynamo finds _init_group's (2.15; from 2.14 "
        "every variable has one, an optimizer's inherited and empty before 2.15)",
        since=(2, 14),
        replaced=True,
    ),
)
