import sys
from pathlib import Path

# The model zoo (tests/zoo.py) is shared by the test suite and the benchmarks.
sys.path.insert(0, str(Path(__file__).parent))


def _own_inductor_cache() -> None:
    """The suite compiles into an inductor cache of this checkout's own (unless
    ``TORCHINDUCTOR_CACHE_DIR`` says where): two suites of two checkouts sharing
    inductor's default cache compiled one kernel at once, and one of them loaded the
    other's half-written library ("main.so: file too short"). Before torch is imported:
    inductor writes its default into the variable the first time it asks."""
    import hashlib
    import os
    import tempfile

    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        checkout = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:12]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor-pytest-torchmem-{checkout}"
        )


_own_inductor_cache()

# Before any test module (and transformers, which imports torchvision when it is
# installed): torchvision's wheel needs the CUDA build of torch to import as is.
from torchvision_import import import_torchvision  # noqa: E402

import_torchvision()


def _capped_inductor_cache() -> None:
    """A run capped below this host's level (``ATEN_CPU_CAPABILITY``, as ``.ci/run``
    does) compiles into an inductor cache of its level's own: inductor's cache keys
    do not tell the levels apart (see ``capped_inductor_cache``)."""
    import os

    if "ATEN_CPU_CAPABILITY" in os.environ:
        from pytest_torchmem.engine.tracing.devices.cpu.profiles import capped_inductor_cache, host_profile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = capped_inductor_cache(host_profile().isa)


_capped_inductor_cache()


def _settle_autograd_threads() -> None:
    """Each test process runs its first backward before any test's fake mode: on a CUDA
    build a backward under a fake mode starts autograd's device threads, after which
    measure(parallel=...) must spawn its ranks (pickling the test's local functions)
    instead of forking them; which test ran first would decide it."""
    from pytest_torchmem.engine.parallel.real_ranks import settle_autograd_threads

    settle_autograd_threads()


_settle_autograd_threads()


def _pipelining_imported() -> None:
    """``torch.distributed.pipelining`` registers operators (``pippy::_pipe_split``) as it is
    imported, once per process: imported first inside a pytester run (the pipeline
    example suite), the run's teardown drops the module, and the next import anywhere in
    the worker fails on the second registration. Imported here, before any run."""
    import torch.distributed

    if torch.distributed.is_available():
        import torch.distributed.pipelining  # noqa: F401


_pipelining_imported()

from collections.abc import Iterator  # noqa: E402
from typing import Final  # noqa: E402

import pytest  # noqa: E402
from exactness import intra_op_threads, release_gap  # noqa: E402


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}thread")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test at 1, 2 and 4 intra-op threads (CPU kernels' buffers depend on it)."""
    with intra_op_threads(request.param) as n:
        yield n


#: Verification that only CI runs (``.ci/run``: ``python -m pytest -n 2 --exhaustive -m
#: exhaustive``), kept out of the README's test command so that it stays within minutes
#: on a busy 2-core machine: each repeats, over CPU levels and thread counts in capped
#: subprocesses or at 7B scale, what a quicker test of the same property checks once.
EXHAUSTIVE: Final = (
    # the 10 compiled families x 3 capped levels x 3 thread counts (test_the_estimate_follows_the_compiled_program: the host)
    "tests/test_compiled.py::test_the_estimate_under_a_named_profile_is_that_cpus",
    # the accuracy families on every level at 1 and 4 threads (test_accuracy_cpu.py: the host)
    "tests/test_accuracy_profiles.py::test_every_family_is_exact_on_the_level",
    # 10 capped processes (test_the_host_level_follows_the_caps_of_the_process: one)
    "tests/test_cpu_profiles.py::test_a_named_profile_gives_the_same_bytes_under_any_caps_and_thread_count",
    # torchao's low-bit optimizers, each compiling its step for tens of seconds
    # (test_a_quantized_state_is_read_by_measure_and_charged_as_optimizer_state: an eager one)
    "tests/test_torchao.py::test_an_8bit_adamw_step_is_exact_and_its_state_is_optimizer_state",
    "tests/test_torchao.py::test_every_low_bit_optimizer_step_is_exact",
    # torchao's cases on every level at 1 thread, float8 at 2 too (test_float8_training_is_exact: the host)
    "tests/test_torchao.py::test_torchao_is_exact_on_every_level",
    # peft's models' optimizer state and gradients counted by hand on both devices (their
    # figures against measure on cpu, and their cuda traces: test_public_models.py's own)
    "tests/test_public_models.py::test_peft_trains_the_adapters_only",
    # every family's three-iteration loop replayed on cpu (test_replay.py: on cuda, and
    # every replayable optimizer on both devices)
    "tests/test_replay.py::test_each_family_replays_a_longer_loop_to_the_same_bytes_on_cpu",
    # torch's encoder's blocks replayed on cpu, each mode (the cuda twins stay, and the cpu
    # twins of the other models)
    "tests/test_block_replay.py::test_repeated_blocks_replay_to_the_same_bytes[loop-encoder post-norm-cpu]",
    "tests/test_block_replay.py::test_repeated_blocks_replay_to_the_same_bytes[loop-encoder pre-norm-cpu]",
    "tests/test_block_replay.py::test_repeated_blocks_replay_to_the_same_bytes[once-encoder post-norm-cpu]",
    "tests/test_block_replay.py::test_repeated_blocks_replay_to_the_same_bytes[once-encoder pre-norm-cpu]",
    "tests/test_block_replay.py::test_repeated_blocks_replay_to_the_same_bytes[forward only-encoder post-norm-cpu]",
    "tests/test_block_replay.py::test_repeated_blocks_replay_to_the_same_bytes[forward only-encoder pre-norm-cpu]",
    # every case of each GPU census recorded for this release (test_gpu_census.py: the
    # first cases of each record)
    "tests/test_gpu_census.py::test_every_recorded_case_replays_to_the_record",
    # Llama 7B under FSDP2 at 8 and 64 ranks (test_parallel.py: small models against gloo ranks)
    "tests/test_scale.py::test_llama_7b_fsdp2_per_rank_hand_count_on_cuda",
    # the plugin's behaviours under xdist, each the twin of a one-process run of the same
    # test (named with its parameter: the one-process run stays in the README's command),
    # each tens of seconds of workers starting
    "tests/test_plugin_releases.py::test_another_releases_entries_are_never_unused_here[xdist]",
    "tests/test_plugin_fit.py::test_torchmem_fit_reports_and_gates_the_largest_size[xdist]",
    "tests/test_plugin_trace_stops.py::test_a_stopped_check_fails_with_where_and_why_and_writes_no_entry[xdist]",
    "tests/test_plugin_reliability.py::test_last_failed_update_keeps_the_entries_of_the_tests_it_did_not_run[xdist]",
    "tests/test_plugin_lifecycle.py::test_update_pass_regress_read_accept[xdist]",
    "tests/test_plugin_keep_output.py::test_flipping_keep_output_fails_until_the_entry_is_re_recorded[xdist]",
    "tests/test_html_report.py::test_report_of_a_run_with_passing_regressing_and_missing_checks[xdist]",
    "tests/test_plugin_reliability.py::test_a_numpy_figure_from_the_adjust_hook_is_taken_as_its_integer[xdist]",
    "tests/test_plugin_leaks.py::test_the_option_checks_every_check[xdist]",
    # the same under xdist, whose one-process twins stay (test_plugin_outcomes.py's
    # outcomes, test_plugin_stopped_updates.py's stops) or that xdist alone can show
    # (a worker that crashes): each tens of seconds of workers starting
    "tests/test_plugin_outcomes.py::test_under_xdist_the_workers_reports_carry_the_verdict",
    "tests/test_plugin_stopped_updates.py::test_under_xdist_a_stop_writes_what_the_table_says_was_written",
    "tests/test_plugin_reliability.py::test_a_crashed_worker_loses_no_check_it_made_and_the_update_says_so",
    # the how-tos' slowest examples, each a run of the APIs their own tests cover
    # (test_generate.py, test_fit.py, test_compiled.py): the documentation's word checked
    "tests/test_docs.py::test_an_example_of_the_documentation_runs[docs/howto/generation.md#1]",
    "tests/test_docs.py::test_an_example_of_the_documentation_runs[docs/howto/fit.md#1]",
    "tests/test_docs.py::test_an_example_of_the_documentation_runs[docs/howto/compiled-models.md#1]",
    "tests/test_docs.py::test_an_example_of_the_documentation_runs[docs/howto/compiled-models.md#2]",
    # the replays' cpu twins, whose cuda twins stay (and test_replay.py's families replaying on
    # cpu: test_the_families_replay); a longer loop on cuda (the 2-iteration loop stays)
    "tests/test_replay.py::test_each_family_replays_to_the_same_bytes[*-cpu]",
    "tests/test_replay.py::test_each_optimizer_replays_its_step_to_the_same_bytes[*-cpu]",
    "tests/test_replay.py::test_each_family_replays_a_longer_loop_to_the_same_bytes",
    "tests/test_block_replay.py::test_repeated_blocks_replay_to_the_same_bytes[*-cpu]",
    "tests/test_block_replay.py::test_transformers_decoder_layers_replay[*-cpu]",
    "tests/test_block_replay.py::test_fsdp2_units_replay_on_a_rank_to_the_same_bytes[cpu]",
    "tests/test_block_replay.py::test_tensor_parallel_inside_fsdp2_units_replays_to_the_same_bytes[cpu]",
    "tests/test_block_replay.py::test_pipeline_stages_replay_their_blocks_to_the_same_bytes[*-GPipe-cpu]",
    "tests/test_block_replay.py::test_pipeline_stages_replay_their_blocks_to_the_same_bytes[last-1F1B-cuda]",
    "tests/test_block_replay.py::test_a_pipeline_whose_gradients_add_up_over_micro_batches_replays_its_set_up_only",
    "tests/test_block_replay.py::test_a_pipeline_replay_that_cannot_stand_is_traced_again",
    "tests/test_block_replay.py::test_several_stages_per_rank_replay_their_blocks_to_the_same_bytes[*]",
    "tests/test_block_replay.py::test_fsdp2_units_kept_gathered_after_forward_replay[forward only]",
    # the KV cache's replays: transformers' Llama on both devices, GPT-2 and the sliding layers on
    # cpu, the cache kept through the backward or dropped before it (the step's default: GPT-2
    # on cuda and measure stay), the cuda leak check and forward, the blocks doing more with
    # their number on cpu (the cpu leak check, the own blocks and the cuda cases stay)
    "tests/test_replay_kv_cache.py::test_transformers_decoders_filling_their_cache_replay[llama-*]",
    "tests/test_replay_kv_cache.py::test_transformers_decoders_filling_their_cache_replay[gpt2-cpu]",
    "tests/test_replay_kv_cache.py::test_layers_sliding_and_not_in_turn_are_traced_and_say_why",
    "tests/test_replay_kv_cache.py::test_a_cache_held_through_the_backward_or_dropped_before_it_replays_to_the_same_bytes[output kept-*]",
    "tests/test_replay_kv_cache.py::test_a_cache_held_through_the_backward_or_dropped_before_it_replays_to_the_same_bytes[output dropped-*]",
    "tests/test_replay_kv_cache.py::test_a_leak_check_of_a_decoder_filling_its_cache_replays_to_the_same_growth[cuda]",
    "tests/test_replay_kv_cache.py::test_forward_only_a_decoder_filling_its_cache_replays[cuda]",
    "tests/test_replay_kv_cache.py::test_blocks_doing_more_with_their_number_or_cache_are_traced_and_say_why[cpu-*]",
    "tests/test_replay_kv_cache.py::test_a_step_functions_decoder_filling_its_cache_replays_to_the_same_bytes[*-cpu]",
    "tests/test_replay_kv_cache.py::test_a_step_functions_decoder_filling_its_cache_replays_to_the_same_bytes[keeps-cuda]",
    # (a step function's blocks: one step on each device stays)
    "tests/test_block_replay.py::test_a_step_functions_blocks_replay_to_the_same_bytes[accumulating-*]",
    "tests/test_block_replay.py::test_a_step_functions_blocks_replay_to_the_same_bytes[three steps-*]",
    # an optimizer step that keeps more each step, or changes at its third, measured over
    # four iterations (test_a_late_change_of_the_optimizer_is_measured_as_it_runs: the change)
    "tests/test_replay.py::test_an_optimizer_step_that_may_differ_is_traced_and_says_why[kept]",
    "tests/test_replay.py::test_an_optimizer_step_that_may_differ_is_traced_and_says_why[state]",
    # four of five schedules of several stages per rank against real gloo ranks (the
    # interleaved 1F1B stays)
    "tests/test_pipeline.py::test_several_stages_per_rank_equal_real_gloo_ranks[ScheduleLoopedBFS]",
    "tests/test_pipeline.py::test_several_stages_per_rank_equal_real_gloo_ranks[ScheduleInterleavedZeroBubble]",
    "tests/test_pipeline.py::test_several_stages_per_rank_equal_real_gloo_ranks[ScheduleDualPipeV]",
    "tests/test_pipeline.py::test_several_stages_per_rank_equal_real_gloo_ranks[ScheduleZBVZeroBubble]",
    # the 3-D rank's last stage against real gloo ranks (its first stage, rank 0, stays)
    "tests/test_pipeline.py::test_pipeline_by_fsdp_by_tensor_parallel_equals_gloo_ranks[3]",
    # three of five collectives whose exchanged integer sizes a tensor, against real ranks
    # (all_to_all, expert parallel's own, and all_reduce stay)
    "tests/test_expert_parallel.py::test_an_exchanged_integer_sizes_a_tensor_as_on_real_ranks[reduce_scatter]",
    "tests/test_expert_parallel.py::test_an_exchanged_integer_sizes_a_tensor_as_on_real_ranks[all_gather]",
    "tests/test_expert_parallel.py::test_an_exchanged_integer_sizes_a_tensor_as_on_real_ranks[broadcast]",
    # ranks forked again after a stall: tens of seconds of forks and time-outs
    "tests/test_threads.py::test_ranks_that_do_not_get_ready_are_forked_again",
    # the beam search's twins of greedy decoding's (test_generate.py)
    "tests/test_generate.py::test_the_cache_grows_with_the_tokens_generated[beam]",
    "tests/test_generate.py::test_an_end_of_sequence_token_makes_the_estimate_an_upper_bound[beam]",
    # the example suites beyond the three promised ones and the leak checks, each a pytest
    # run against its snapshots: the README's main job runs them all (and CI's release
    # suites name the test, so that every release runs them)
    *(
        f"tests/test_plugin_examples.py::test_example_suite_passes_against_its_committed_snapshot[{name}]"
        for name in ("generation", "pipeline", "fsdp", "script", "training_loop", "accelerate_loop", "hf_trainer", "lightning_trainer")
    ),
    # GPT-2 compiled on the fake cuda device (test_compiled_cuda.py's transformer family stays)
    "tests/test_public_models.py::test_the_fake_cuda_device_follows_it_compiled",
    # pp x DDP against real gloo ranks (the two-stage schedules and pp x FSDP x TP stay)
    "tests/test_pipeline.py::test_pipeline_by_data_parallel_equals_real_gloo_ranks",
    # the plugin's compiled and eager entries side by side (its regression report stays)
    "tests/test_plugin_compile.py::test_eager_and_compiled_entries_side_by_side",
    # a graph break in a compiled module on cuda (its cpu twin, test_compiled.py's, stays)
    "tests/test_compiled_cuda.py::test_the_cuda_program_is_followed[graph break]",
    # every example suite with the optional packages hidden (the frameworks' suites and a
    # step function's stay)
    "tests/test_plugin_examples.py::test_without_the_optional_packages_each_suite_passes_or_names_what_to_install[every suite]",
    # one of each kind of command line stays (test_cli_fit.py)
    "tests/test_cli_fit.py::test_the_output_carries_no_notice_of_transformers[command1]",
    "tests/test_cli_fit.py::test_a_factory_that_raises_or_holds_an_unknown_option_is_one_line_and_exit_2[module-factory-raises]",
    "tests/test_cli_fit.py::test_a_factory_that_raises_or_holds_an_unknown_option_is_one_line_and_exit_2[file-raises]",
    # a second size of dynamic shapes on the fake cuda device (4 stays)
    "tests/test_compiled_cuda.py::test_dynamic_shapes[8]",
    # three compiled families on the host's level (the other seven stay; every family runs
    # at avx2:4 in the first entry's test, conv-bn-relu and adamw step at 1 thread without
    # AVX too)
    "tests/test_compiled.py::test_the_estimate_follows_the_compiled_program[conv-bn-relu]",
    "tests/test_compiled.py::test_the_estimate_follows_the_compiled_program[adamw step]",
    "tests/test_compiled.py::test_the_estimate_follows_the_compiled_program[dynamic]",
    # three public models against a real CPU run whose kin stay (torchvision's EfficientNet
    # and MobileNet v3, GPT-2 checkpointed without reentrancy); their cuda traces stay
    "tests/test_public_models.py::test_cpu_estimate_equals_measure[efficientnet]",
    "tests/test_public_models.py::test_cpu_estimate_equals_measure[mobilenet v2]",
    "tests/test_public_models.py::test_cpu_estimate_equals_measure[gpt2 checkpointed (reentrant)]",
    # three families against a real CPU run that test_same_program.py's matrix runs against
    # measure too (its T5 with LoRA stays in the README's command); their cuda traces stay
    "tests/test_public_models.py::test_cpu_estimate_equals_measure[t5]",
    "tests/test_public_models.py::test_cpu_estimate_equals_measure[mixtral]",
    "tests/test_public_models.py::test_cpu_estimate_equals_measure[whisper]",
    # transformers' own activation offloading (the offloading as libraries write it stays)
    "tests/test_real_run_view.py::test_transformers_activation_offloading_takes_each_checkpointed_layers_input_off_the_gpu",
    # torch's pre-norm encoder under autocast, traced again (the Llama replayed stays)
    "tests/test_block_replay.py::test_blocks_under_autocast_replay_or_are_traced_again[encoder*]",
    # the callables blocks hold, on cuda, but a closure's (their cpu twins stay)
    "tests/test_block_replay.py::test_blocks_holding_their_own_closure_of_one_function_replay[bound method-cuda]",
    "tests/test_block_replay.py::test_blocks_holding_their_own_closure_of_one_function_replay[partial-cuda]",
    "tests/test_block_replay.py::test_blocks_holding_their_own_closure_of_one_function_replay[lambda-cuda]",
    # -- the README's command within its 8 minutes on 2 cores (issue 55 added compiled cases):
    # a pipeline's first stage replaying its blocks on cuda (the pipelines against real gloo
    # ranks stay, test_pipeline.py; every other stage and schedule replaying is above)
    "tests/test_block_replay.py::test_pipeline_stages_replay_their_blocks_to_the_same_bytes[first-1F1B-cuda]",
    # two pytest runs in a venv without numpy, two update runs watched for lock files, a
    # compiled model's leak check (the eager leak checks stay), the host's level under ten
    # caps (a named profile's figures under caps are above), torch as it was after a compiled
    # cuda trace (the compiled cpu trace's twin stays)
    "tests/test_plugin_imports.py::test_a_project_without_numpy_sees_no_numpy_warning",
    "tests/test_plugin_reliability.py::test_updates_leave_no_lock_file",
    "tests/test_leak_checks.py::test_a_compiled_model_is_checked_as_its_compiled_program_runs",
    "tests/test_cpu_profiles.py::test_the_host_level_follows_the_caps_of_the_process",
    "tests/test_torch_replacements.py::test_every_replacement_is_a_table_entry_and_torch_is_as_before[compiled-cuda]",
    # three more compiled families on the host's level (mlp, regional, compiled function,
    # adamw function stay; every family runs at avx2:4 above), and torchvision's MobileNet v3
    # against a real CPU run (ResNet-18 and its cuda trace stay)
    "tests/test_compiled.py::test_the_estimate_follows_the_compiled_program[transformer]",
    "tests/test_compiled.py::test_the_estimate_follows_the_compiled_program[selective checkpointing]",
    "tests/test_compiled.py::test_the_estimate_follows_the_compiled_program[graph break]",
    "tests/test_public_models.py::test_cpu_estimate_equals_measure[torchvision mobilenet v3 small]",
    # a second Llama recipe compiled layer by layer (torch.compile(layer) in its place: the
    # layer.compile() twin stays) and the 128k vocabulary's loss in four chunks (one stays)
    "tests/test_compiled_everywhere.py::test_layers_compiled_one_by_one_through_a_step_function_equal_measure[torch.compile(layer)]",
    "tests/test_compiled_everywhere.py::test_a_compiled_loss_keeps_no_float32_logits_at_a_128k_vocabulary[4]",
    # an ini table's GPU through the plugin (the marker's and the option's GPUs stay), a
    # compiled cuda program's listed op located (the cpu program's buffers located stays),
    # the command line gating CI on a size (its other commands stay), two processes
    # updating one file (the one-process updates stay), advice added to a failure through
    # the plugin (tests/test_advice.py's API stays), two compiled families on cuda (the
    # other four stay)
    "tests/test_plugin_gpu_profiles.py::test_a_gpu_of_the_ini_table_is_checked_recorded_and_named",
    "tests/test_compiled_cuda.py::test_an_op_listed_in_a_compiled_program_is_located_at_the_users_line",
    "tests/test_cli_fit.py::test_at_least_gates_ci",
    "tests/test_plugin_lifecycle.py::test_two_processes_updating_one_file_lose_no_entry",
    "tests/test_plugin_fit.py::test_advise_adds_what_would_fit_to_the_failure",
    "tests/test_compiled_cuda.py::test_the_cuda_program_is_followed[conv-bn-relu]",
    "tests/test_compiled_cuda.py::test_the_cuda_program_is_followed[regional]",
    # the frameworks' example suites with their packages hidden (CI's main job checks every
    # suite's verdict), the command line's fit progress (its table of GPUs stays), tensor
    # parallel inside FSDP2 units replayed on cuda (FSDP2's units replayed stay), a parallel
    # measure's stderr (a pytest run's silence stays)
    "tests/test_plugin_examples.py::test_without_the_optional_packages_each_suite_passes_or_names_what_to_install[frameworks and a step function]",
    "tests/test_cli_fit.py::test_fit_names_the_size_and_prints_its_progress",
    "tests/test_block_replay.py::test_tensor_parallel_inside_fsdp2_units_replays_to_the_same_bytes[cuda]",
    "tests/test_measure_output.py::test_a_parallel_measure_writes_nothing_to_stderr",
    # layers put back compiled (torch.compile(layer)) replaying on cuda (the cpu twin, against
    # measure, and layer.compile()'s on cuda stay)
    "tests/test_compiled_replay.py::test_compiled_layers_replay_on_cuda_as_traced_block_by_block[torch.compile(layer)]",
)


def _exhaustive(nodeid: str) -> bool:
    """Whether ``nodeid`` is listed in :data:`EXHAUSTIVE`: by its node id, its test's (any
    parameter), or a pattern with one ``*`` (``[*-cpu]``: every cpu twin)."""
    for entry in EXHAUSTIVE:
        head, star, tail = entry.partition("*")
        if star and nodeid.startswith(head) and nodeid.endswith(tail):
            return True
        if nodeid == entry or nodeid.split("[")[0] == entry:
            return True
    return False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="also run the exhaustive verification that .ci/run runs (tests/conftest.py: EXHAUSTIVE)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exhaustive: verification only CI runs (--exhaustive)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # (listed here, or marked where the test is written: a matrix's rows beyond its quick ones)
    exhaustive = [item for item in items if _exhaustive(item.nodeid) or item.get_closest_marker("exhaustive")]
    for item in exhaustive:
        item.add_marker(pytest.mark.exhaustive)
    # without --exhaustive they are left out, but for one named on the command line by
    # its node id or its test's (.ci/run's release suites name one level of the accuracy
    # families, and every example suite's run)
    named = set(config.args)
    left_out = [item for item in exhaustive if item.nodeid not in named and item.nodeid.split("[")[0] not in named]
    if not config.getoption("--exhaustive") and left_out:
        config.hook.pytest_deselected(items=left_out)
        gone = set(left_out)
        items[:] = [item for item in items if item not in gone]


@pytest.hookimpl(trylast=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """A test listed in tests/release_gaps.txt for the running torch release is
    expected to fail there (strict: once fixed it fails the run until its line goes)."""
    why = release_gap(item.nodeid)
    if why is not None:
        item.add_marker(pytest.mark.xfail(reason=f"{why} (issue 24, open)", strict=True))
