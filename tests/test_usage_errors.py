"""Mistakes a user makes on first contact, each refused in one line that names the
problem and the fix (issue 36): the model's factory passed in place of the model, an
optimizer whose step needs a closure in the built-in step. Through the API and, end to
end, through the ``torchmem`` fixture."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import pytest
import torch
from torch import nn

import pytest_torchmem as tm

pytest_plugins = ("pytester",)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def make_sized(hidden: int, depth: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(depth)))


# -- a factory in place of the model -----------------------------------------------------------


@pytest.mark.parametrize("entry", [tm.estimate, tm.measure])
def test_a_factory_of_no_arguments_passed_as_the_model_is_named(entry: Any) -> None:
    """Regression guard: ``make_model`` (not called) ran as a step function and failed
    with ``make_model() takes 0 positional arguments`` deep in the trace."""
    with pytest.raises(TypeError) as raised:
        entry(make_model, torch.randn(4, 8))
    message = str(raised.value)
    assert "\n" not in message
    assert message == (
        f"{entry.__name__}() runs a callable that is not an nn.Module as a step function on the "
        "inputs, and make_model() takes no arguments: the model's factory was passed instead of "
        f"the model; pass the model it makes, {entry.__name__}(make_model(), inputs)"
    )


def test_a_callable_that_cannot_take_the_inputs_says_what_it_takes() -> None:
    with pytest.raises(TypeError) as raised:
        tm.estimate(make_sized, torch.randn(4, 8))
    message = str(raised.value)
    assert "\n" not in message
    assert "make_sized(hidden: 'int', depth: 'int') -> 'nn.Module' cannot take them" in message
    assert "missing a required argument: 'depth'" in message
    assert message.endswith("the model it makes, estimate(make_sized(...), inputs)")


def test_a_module_class_passed_as_the_model_is_named() -> None:
    with pytest.raises(TypeError, match=re.escape("got the class Linear, not a model: pass a model made from it, estimate(Linear(...), inputs)")):
        tm.estimate(nn.Linear, torch.randn(4, 8))


def _supplies_the_model(function: Any) -> Any:
    """A decorator that gives the function its first argument (``functools.wraps``: its
    signature reads as the function's, which the inputs do not fit)."""
    model = make_model()

    @functools.wraps(function)
    def wrapper(*args: Any) -> Any:
        return function(model, *args)

    return wrapper


@_supplies_the_model
def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def test_step_functions_that_take_their_inputs_still_run() -> None:
    """No false alarm: a step function with defaults, ``*args``, a wrapper that supplies
    an argument, a partial, a callable object, or a builtin whose signature can't be read."""

    def with_default(model: nn.Module, x: torch.Tensor, scale: float = 1.0) -> None:
        (model(x).sum() * scale).backward()

    class Step:
        def __call__(self, *parts: Any) -> None:
            with_default(*parts)

    model, x = make_model(), torch.randn(4, 8)
    assert tm.estimate(with_default, (model, x)).backward_peak > 0
    assert tm.estimate(_step, (x,)).backward_peak > 0
    assert tm.estimate(functools.partial(with_default, model), (x,)).backward_peak > 0
    assert tm.estimate(Step(), (model, x)).backward_peak > 0
    with pytest.raises(ValueError):
        inspect.signature(torch.relu)
    assert tm.estimate(torch.relu, (x,)).peak > 0


# -- an optimizer whose step needs a closure -------------------------------------------------

LBFGS_LINE = (
    "LBFGS.step() needs a closure that recomputes the loss, and the built-in step (optimizer=) "
    "calls step() without one: check a step function that gives it one, in place of the model "
    "with the optimizer among its arguments, tm.estimate(train_step, (model, inputs, opt)) or "
    "torchmem.check(train_step, (model, inputs, opt)) where opt = "
    "torch.optim.LBFGS(model.parameters()) and train_step(model, inputs, opt) calls "
    "opt.step(closure), closure() zeroing the gradients, running forward and backward and "
    'returning the loss (docs/howto/step-function.md, "An optimizer that needs a closure")'
)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lbfgs_in_the_built_in_step_says_to_give_it_a_closure(device: str) -> None:
    """Regression guard: torch's ``step() missing 1 required positional argument:
    'closure'`` from inside the trace."""
    model = make_model()
    with pytest.raises(TypeError) as raised:
        tm.estimate(model, torch.randn(4, 8), device=device, optimizer=lambda p: torch.optim.LBFGS(p))
    assert str(raised.value) == LBFGS_LINE
    with pytest.raises(TypeError, match=re.escape(LBFGS_LINE)):
        tm.measure(model, torch.randn(4, 8), optimizer=torch.optim.LBFGS)


def test_the_step_function_the_message_shows_runs() -> None:
    model, x = make_model(), torch.randn(4, 8)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=2)

    def train_step(model: nn.Module, inputs: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(inputs).square().mean()
            loss.backward()
            return loss

        opt.step(closure)

    assert tm.estimate(train_step, (model, x, opt)).step_peak > 0
    assert opt.state == {} and all(p.grad is None for p in model.parameters())


# -- in pytest ---------------------------------------------------------------------------------

FACTORY_TESTS = """
from collections.abc import Mapping

import torch
from torch import nn


def make_model():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_factory(torchmem):
    torchmem.check(make_model, torch.randn(4, 8))


class Batch(Mapping):
    def __getitem__(self, key):
        return torch.randn(4, 8)

    def __len__(self):
        return 1

    def __iter__(self):
        raise TypeError("a batch of the user's, broken")


def test_broken_batch(torchmem):
    torchmem.check(make_model(), Batch())
"""


def test_the_fixture_names_a_factory_passed_as_the_model(pytester: pytest.Pytester) -> None:
    """Regression guard: ``torchmem.check(make_model, x)`` failed with ``TypeError:
    make_model() takes 0 positional arguments`` under 13 frames of the plugin. Now one
    line at the test's call; a ``TypeError`` of the user's own code met while the
    arguments are read keeps its traceback."""
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makepyfile(test_m=FACTORY_TESTS)
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(failed=2)
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        [
            "E*TypeError: torchmem.check() runs a callable that is not an nn.Module as a step "
            "function on the inputs, and make_model() takes no arguments: the model's factory was "
            "passed instead of the model; pass the model it makes, torchmem.check(make_model(), inputs)"
        ]
    )
    text = result.stdout.str()
    assert "takes 0 positional arguments" not in text
    factory = text.split("= FAILURES =")[1].split("_ test_broken_batch _")[0]
    assert "pytest_torchmem" not in factory, factory
    # an error of the user's own code met on the way keeps its whole traceback
    result.stdout.fnmatch_lines(
        ['>*raise TypeError("a batch of the user\'s, broken")', "E*TypeError: a batch of the user's, broken"]
    )


LBFGS_TESTS = """
import torch
from torch import nn


def test_lbfgs(torchmem):
    model = nn.Linear(8, 2)
    torchmem.check(model, torch.randn(4, 8), optimizer=lambda params: torch.optim.LBFGS(params))
"""


def test_the_fixture_says_lbfgs_needs_a_closure_at_the_tests_call(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntorchmem_devices = cpu\n")
    pytester.makepyfile(test_m=LBFGS_TESTS)
    result = pytester.runpytest("--torchmem-update")
    result.assert_outcomes(failed=1)
    assert result.ret == 1
    result.stdout.fnmatch_lines([">*torchmem.check(model, *", "E*TypeError: " + LBFGS_LINE.replace("[", "[[]"), "test_m.py:7: *Error"])
    failure = result.stdout.str().split("= FAILURES =")[1]
    assert "missing 1 required positional argument" not in failure
    assert "pytest_torchmem" not in failure.split("short test summary")[0], failure
