"""An op fake tensors cannot run, run on the values the trace knows: the tracker's fallback.

Where a fake kernel raises because the op needs its inputs' values (``nonzero``,
``.item()``, a shape read from a tensor) or because it has no fake or meta kernel, the
values of small tensors that the trace knows beside it (:mod:`.values`) run the op for
real, and fake outputs of the real outputs' geometry stand for them. Where a value is not
known, a value-dependent op follows its fallback rule (exact where the values it needs
are known, else listed in ``unsupported``), and an op that cannot run stops the trace
(:mod:`.stops`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import torch

from pytest_torchmem.engine.figures.report import Unsupported
from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.tracing.op_plans import OpPlan
from pytest_torchmem.engine.tracing.rules import OpCall, RuleSet, TraceContext
from pytest_torchmem.engine.tracing.stops import CANNOT_RUN, VALUES
from pytest_torchmem.engine.user.user_code import user_location

if TYPE_CHECKING:
    from pytest_torchmem.engine.tracing.values import KnownValues

__all__ = ["OnValues"]

# torch's private names (engine/torch_compat/torch_private.py)
FakeTensor: Final = private("torch._subclasses.fake_tensor.FakeTensor")


class OnValues:
    """The tracker's runs of ops on known values (:class:`~.tracker.Tracker` is one).

    What it uses of the tracker: the values it knows, the device's rules, the fake
    device, the ``unsupported`` list and the count of values missed, and the tracker's
    ``_report_inexact`` and ``_abort``.
    """

    values: KnownValues
    rules: RuleSet
    context: TraceContext
    device: torch.device
    unsupported: list[Unsupported]
    values_missed: int
    _assumed: Unsupported | None

    if TYPE_CHECKING:

        def _report_inexact(self, op: str, reason: str) -> None: ...

        def _abort(self, func: Any, reason: str, advice: str) -> None: ...

    def _ran_on_values(self, plan: OpPlan, args: Any, kwargs: Any, cannot_run: str) -> tuple[Any, Any]:
        """The outputs of an op fake tensors cannot run (``cannot_run`` says why), and their
        real values: run on the values where every argument's value is known, else the
        trace stops."""
        func = plan.func
        known, real_out = self.values.run(func, plan.values, args, kwargs)
        if not known:
            self.values_missed += 1
            self._abort(func, f"fake tensors cannot run it ({cannot_run})", CANNOT_RUN)
        return self._from_values(plan, real_out, args), real_out

    def _data_dependent(self, plan: OpPlan, args: Any, kwargs: Any, why: str) -> tuple[Any, Any]:
        """The outputs of a value-dependent op, and their real values (or ``None``):
        run on the values where the trace knows every argument's, else the op's
        fallback rule (exact where the values it needs are known)."""
        func = plan.func
        known, real = self.values.run(func, plan.values, args, kwargs)
        if known:
            return self._from_values(plan, real, args), real
        self.values_missed += 1
        fallback = self.rules.fallback_rule(func)
        if fallback is None:
            self._abort(func, f"output depends on tensor values ({why})", VALUES)
        out, reason = fallback(OpCall(func, args, kwargs, context=self.context))
        if reason is not None:
            entry = Unsupported(str(func), reason, user_location())
            self.unsupported.append(entry)
            if self._assumed is None:
                self._assumed = entry
        return out, None

    def _from_values(self, plan: OpPlan, real: Any, args: Any) -> Any:
        """Fake outputs like ``real``, the op's outputs run on the values. The device
        model vouches for the kernel's other buffers where it has a rule for the op
        (a scratch rule, or a fallback written for it); otherwise the op is listed."""
        if plan.scratch is None and self.rules.fallback_rule(plan.func) is None:
            self._report_inexact(
                plan.name,
                "its outputs were made from the tensors' values (fake tensors cannot run it); "
                "what its kernel allocates beside them is not modelled",
            )
        return self._faked(real, args)

    def _faked(self, real: Any, args: Any) -> Any:
        """Fake tensors with the geometry (and storage size) of the real outputs ``real``."""
        if isinstance(real, (tuple, list)):
            return type(real)(self._faked(r, args) for r in real)
        if not isinstance(real, torch.Tensor):
            return real
        device = next(
            (a.fake_device for a in _tensors_in(args) if type(a) is FakeTensor), self.device
        )
        # (not fake_like: FakeTensorMode's dispatch cache keeps the storage given to
        # set_, which would never be freed)
        out = torch.empty(
            real.untyped_storage().nbytes() // real.element_size(), dtype=real.dtype, device=device
        )
        return out.as_strided_(real.shape, real.stride(), real.storage_offset())


def _tensors_in(values: Any) -> Iterable[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value
