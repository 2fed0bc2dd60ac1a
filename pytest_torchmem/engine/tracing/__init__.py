"""The fake-tensor tracer: one step on fake tensors, every storage recorded.

- The trace: :mod:`.trace` traces one step and reads its report; :mod:`.layers` are the
  contexts a traced step runs in, in order; :mod:`.pipeline_group` traces a pipeline's
  ranks together; :mod:`.stops` says why a trace stopped.
- Op by op: :mod:`.tracker` is the dispatch mode; :mod:`.ledger` keeps the storages;
  :mod:`.op_plans` works out what each op's schema and rules say; :mod:`.rules` is the
  per-op rule registry, filled per device in :mod:`.devices`; :mod:`.autograd_eager`
  makes autograd on fake tensors act as on plain ones; :mod:`.fake_limits` tells what
  fake tensors cannot do; :mod:`.on_values` runs an op they cannot run on the values
  the trace knows (:mod:`.values`, :mod:`.exchanged_values`); :mod:`.sparse_calls` is
  the trace's side of sparse tensors.
- What the traced program sees: :mod:`.the_program` tells who asks; :mod:`.real_run_view`
  answers as a real run; :mod:`.metric_reads`, :mod:`.imports`, :mod:`.rng_states`,
  :mod:`.module_methods`, :mod:`.generation` (transformers' generation loop).
- Compiled code: :mod:`.compiled` (regions met), :mod:`.compiled_program` and
  :mod:`.compiled_cuda` (inductor's program, run on fake tensors), :mod:`.inductor_device`.
- Trace once, replay the rest: :mod:`.replay` (a loop's forward and backward),
  :mod:`.optimizer_replay`, :mod:`.block_replay` (a model's repeated blocks: its keys,
  :mod:`.block_keys`, templates, :mod:`.block_templates`, recorded backwards,
  :mod:`.block_backward`, and FSDP2's units, :mod:`.block_parallel`), with
  :mod:`.replay_events`, :mod:`.replay_state`, :mod:`.replay_watch` and
  :mod:`.replay_caches` (the KV caches a replayed decoder fills).
"""

__all__: list[str] = []
