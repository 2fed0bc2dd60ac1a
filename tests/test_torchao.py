"""torchao's low-bit optimizers and float8 training: estimated as measured (issue 36).

torchao's low-bit optimizers (``torchao.optim``) keep their state in wrapper
subclasses (``OptimState8bit``: its codes, block scales and quantization map) and
step through ``torch.compile`` per parameter: a wrapper subclass has no storage of
its own, and ``measure`` raised reading one ("Attempted to access the data pointer on
an invalid python storage"); its memory is its inner tensors' (``layouts.parts``).
Its float8 training (``torchao.float8``) multiplies through ``_scaled_mm``, whose CPU
kernel is a program of other ops (``devices/cpu/scaled_mm.py``), and takes its scales
from ``max(abs(weight.t()))``, which copies the transposed weight (``reduce.py``).

torchao's optimizers compile their step, which takes tens of seconds to build
(inductor's C++ code generation for the quantization, in the estimate and the real
run alike): they run under ``--exhaustive`` (tests/conftest.py), as do the capped
CPU levels; here an eager optimizer keeps its state in torchao's 8-bit subclass.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torchao")
try:  # a torchao built for another torch release may fail otherwise than by ImportError
    import torchao.optim
    from torchao.float8.float8_training_tensor import Float8TrainingTensor  # noqa: F401
    from torchao.optim.subclass_8bit import OptimState8bit
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"torchao does not import with this torch: {exc}", allow_module_level=True)

from exactness import skip_where_native
from profiled import as_measured_here, every_peak, measure_torchao, reachable
from torchao_cases import CASES, FLOAT8, OPTIMIZERS

import pytest_torchmem as tm
from pytest_torchmem.engine.user.layouts import parts

#: (torchao's low-bit optimizer states, compiled: AOTAutograd's cache asks them for a hash
#: torchao does not give)
pytestmark = pytest.mark.filterwarnings("ignore:OptimState.* does not implement _stable_hash_for_caching:UserWarning")
from pytest_torchmem.engine.figures.report import Category
from pytest_torchmem.engine.tracing.devices.cpu.profiles import ISA_LEVELS, CpuProfile, host_profile


def _exact(name: str, **options: object) -> tm.MemoryReport:
    model, inputs = CASES[name].make()
    estimated = tm.estimate(model, inputs, **CASES[name].options, **options)
    skip_where_native(estimated)
    measured = tm.measure(model, inputs, **CASES[name].options)
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)
    assert estimated.breakdown == measured.breakdown
    return estimated


def test_a_low_bit_optimizer_state_is_its_inner_tensors() -> None:
    """An ``OptimState8bit`` has no storage; its memory is its codes, scales and map."""
    state = OptimState8bit.zeros((64, 64), signed=True, block_size=256)
    with pytest.raises(RuntimeError, match="invalid python storage"):
        state.untyped_storage().data_ptr()
    held = parts(state)
    assert [id(t) for t in held] == [id(state.codes), id(state.scale), id(state.qmap)]
    assert sum(t.untyped_storage().nbytes() for t in held) == 64 * 64 + 16 * 4 + 256 * 4


class _Momentum8bit(torch.optim.Optimizer):
    """SGD with momentum kept in torchao's 8-bit state, stepped eagerly (torchao's own
    optimizers compile their step, which takes tens of seconds)."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum"] = OptimState8bit.zeros(p.shape, signed=True, block_size=256)
                momentum = state["momentum"].dequantize().mul_(0.9).add_(p.grad)
                state["momentum"].copy_(momentum)  # quantized into the codes and scales
                p.add_(momentum, alpha=-0.1)


def test_a_quantized_state_is_read_by_measure_and_charged_as_optimizer_state() -> None:
    """measure reads a wrapper subclass's state (it raised), the estimate equals it in
    every phase and category, and the state is charged as optimizer state: the 4096
    codes, 16 block scales and the 256-float map."""
    model, inputs = CASES["AdamW8bit"].make()
    estimated = tm.estimate(model, inputs, optimizer=_Momentum8bit)
    measured = tm.measure(model, inputs, optimizer=_Momentum8bit)
    assert estimated.unsupported == ()
    assert every_peak(estimated) == every_peak(measured)
    assert estimated.breakdown == measured.breakdown
    assert estimated.breakdown[Category.OPTIMIZER_STATE] == 4096 + 16 * 4 + 256 * 4


def test_an_8bit_adamw_step_is_exact_and_its_state_is_optimizer_state() -> None:
    """measure reads the wrapper subclass's state (it raised), the estimate equals it in
    every phase and category, and the state is charged as optimizer state: two 4096-byte
    code tensors, two 16-float scales and two 256-float maps, and the step counter."""
    estimated = _exact("AdamW8bit")
    assert estimated.breakdown[Category.OPTIMIZER_STATE] == 2 * (4096 + 16 * 4 + 256 * 4) + 4


@pytest.mark.parametrize("case", [c.name for c in OPTIMIZERS if c.name != "AdamW8bit"])
def test_every_low_bit_optimizer_step_is_exact(case: str) -> None:
    """4-bit and float8 states, bfloat16 parameters, bfloat16 stochastic rounding."""
    _exact(case)


@pytest.mark.parametrize("case", [c.name for c in FLOAT8])
def test_float8_training_is_exact(case: str, threads: int) -> None:
    """``_scaled_mm``'s emulated CPU kernel, the scales' reductions and casts, tensorwise
    and rowwise, with and without an optimizer, at 1, 2 and 4 threads."""
    _exact(case)


def test_a_float8_matmul_on_the_amx_level_is_listed() -> None:
    """On the amx level oneDNN runs a tensorwise ``_scaled_mm``: not modelled, listed."""
    model, inputs = CASES["float8 tensorwise float32"].make()
    report = tm.estimate(model, inputs, cpu="amx:2")
    listed = {u.op for u in report.unsupported if "oneDNN" in u.reason}
    assert listed == {"aten._scaled_mm.default"}


def test_a_rowwise_scale_of_another_shape_raises_as_the_kernel_does() -> None:
    """The CPU kernel takes tensorwise or rowwise scales only; the estimate refuses the
    others with the kernel's error (a ValueError), as the real step would."""
    a = torch.randn(32, 64).to(torch.float8_e4m3fn)
    b = torch.randn(128, 64).to(torch.float8_e4m3fn).t()
    scales = (torch.ones(32, 1), torch.ones(128, 1))  # scale_b should be (1, 128)

    def step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(a, b, *scales, out_dtype=torch.float32).sum()

    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        step(a, b)
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        tm.estimate(step, (a, b))


@pytest.mark.parametrize("case", [c.name for c in FLOAT8[:3]])
def test_float8_training_traces_on_the_fake_cuda_device(case: str) -> None:
    """Issue 37 models float8 on cuda exactly; until then it traces, and a rowwise
    ``_scaled_mm`` (whose kernel choice is not modelled) is listed."""
    model, inputs = CASES[case].make()
    report = tm.estimate(model, inputs, device="cuda")
    assert report.backward_peak > report.forward_peak > 0
    listed = {u.op for u in report.unsupported}
    assert listed == ({"aten._scaled_mm.default"} if "rowwise" in case else set())


def test_a_low_bit_optimizer_traces_on_the_fake_cuda_device() -> None:
    """On cuda torchao's compiled per-parameter step (``single_param_adam``, compiled with
    ``fullgraph=True``) is followed, as on cpu, with nothing listed and no warning (the
    program's check of its inputs' alignment reads no fake address); its state is
    charged as optimizer state in 512-byte blocks: the codes (4096 bytes each), scales
    (64) and maps (1024); the step counter and the learning rate stay on the CPU."""
    model, inputs = CASES["AdamW8bit"].make()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Accessing the data pointer of FakeTensor")
        report = tm.estimate(model, inputs, device="cuda", **CASES["AdamW8bit"].options)
    assert report.unsupported == ()
    assert report.step_peak > report.backward_peak
    assert report.breakdown[Category.OPTIMIZER_STATE] == 2 * (4096 + 512 + 1024)


#: The CPU levels this host can run, at 1 and 2 threads: every case at one thread, the
#: float8 ones (whose scales' reductions split by thread) at two too. The low-bit
#: optimizers compile their step per level for tens of seconds; how a compiled
#: program follows the threads is test_compiled.py's (its avx2:4 profile).
PROFILES = [
    CpuProfile(level, threads)
    for level in ISA_LEVELS
    for threads in (1, 2)
    if reachable(CpuProfile(level, 1)) and level not in ("avx512_bf16", "amx")
]


@pytest.mark.parametrize("profile", PROFILES, ids=str)
def test_torchao_is_exact_on_every_level(profile: CpuProfile) -> None:
    """The estimate under a named profile equals measure in a process capped to that
    level and thread count (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ...)."""
    here = as_measured_here(profile)
    names = list(CASES) if profile.threads == 1 else [case.name for case in FLOAT8]
    if host_profile().isa == "amx":
        # on an AMX host torch runs _scaled_mm on oneDNN's float8 matmul whatever the caps,
        # and oneDNN capped below AMX cannot make its primitive: the real run fails there
        # ("could not create a primitive descriptor for the matmul primitive")
        names = [name for name in names if name not in {case.name for case in FLOAT8}]
        if not names:
            pytest.skip("float8 on an AMX host capped below AMX: the real _scaled_mm cannot run")
    measured = measure_torchao(here, names)
    wrong = {}
    for name in names:
        model, inputs = CASES[name].make()
        estimated = tm.estimate(model, inputs, cpu=here, **CASES[name].options)
        if estimated.unsupported or every_peak(estimated) != measured[name]:
            wrong[name] = (every_peak(estimated), measured[name], estimated.unsupported)
    assert wrong == {}
