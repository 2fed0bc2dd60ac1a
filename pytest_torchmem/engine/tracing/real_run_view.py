"""What the traced program asks about its run, answered as a real run answers.

A trace runs the program on fake tensors, under a fake mode and the tracker's
dispatch mode. Code can ask about that, and take another branch than a real run
takes: transformers' ``is_tracing(tensor)`` asks whether a tensor is a
``FakeTensor``, and where it is, keeps a packed-sequence mask a real run drops,
so the traced decoder builds an explicit attention mask and materialises
grouped-query attention's keys and values (+6% on a small Llama trained with
``use_cache=False``). While :func:`real_run_view` is on, the program's own code
(:mod:`~pytest_torchmem.engine.tracing.the_program`: not torch's, not this
package's, on the tracing thread) gets a real run's answers:

* ``torch._subclasses.FakeTensor`` and ``torch._subclasses.fake_tensor.FakeTensor``,
  looked up by name, are a subclass of ``FakeTensor`` that no tensor is an
  instance of: ``isinstance(t, FakeTensor)`` is False, as for every tensor of a
  real run (``issubclass`` of it answers as of ``FakeTensor``: a tensor
  subclass's ``__torch_dispatch__`` that lets fake tensors through still does);
* ``torch._subclasses.fake_tensor.is_fake(t)`` and ``maybe_get_fake_mode(t)``
  are False and None for the trace's tensors; ``torch._guards.detect_fake_mode()``
  finds no fake mode where the one it finds is the trace's;
* ``torch.utils._python_dispatch.is_in_torch_dispatch_mode()`` and
  ``_get_current_dispatch_mode()`` see only the dispatch modes the program
  entered itself, not the trace's.

The compile, export, JIT and FX questions (``torch.compiler.is_compiling()``,
``is_exporting()``, ``torch.jit.is_tracing()``, ``is_scripting()``,
``torch.fx._symbolic_trace.is_fx_tracing()``) and ``torch._is_functional_tensor``
already answer as a real run does: the trace is none of them.

The same names bound in the program's modules before the trace (``from
torch._subclasses.fake_tensor import is_fake`` at a module's import: torchao's MX
formats ask ``is_fake`` so, to choose the compiled program's kernel)
are bound to the same answers while the trace runs, and bound back after: only the
program's code reads its modules' globals (on any thread, while the trace runs).

What cannot be answered so: ``type(t)`` (the trace's tensors are
``FakeTensor``\\ s), and a lookup through ``getattr(module, "FakeTensor")`` (a read
from C code, as dynamo's guards make:
:func:`~pytest_torchmem.engine.tracing.the_program.looks_it_up`); no library this
package is tested against asks in these ways.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from threading import get_ident
from types import FrameType
from typing import Any, Final

from pytest_torchmem.engine.torch_compat.torch_private import private
from pytest_torchmem.engine.torch_compat.torch_replacing import replacing_for_readers
from pytest_torchmem.engine.tracing.the_program import NOT_THE_PROGRAM, is_the_program, looks_it_up

__all__ = ["FAKE_TENSOR_NAMES", "never_an_instance", "real_run_view"]

#: Where the program looks ``FakeTensor`` up by name.
FAKE_TENSOR_NAMES: Final = ("torch._subclasses.FakeTensor", "torch._subclasses.fake_tensor.FakeTensor")
_FAKE_TENSOR: Final = "torch._subclasses.fake_tensor.FakeTensor"
_DISPATCH: Final = "torch.utils._python_dispatch"


@functools.cache
def never_an_instance() -> type:
    """A subclass of ``FakeTensor``, named as it is, that no tensor is an instance of."""
    fake_tensor = private(_FAKE_TENSOR)
    return type(
        fake_tensor.__name__,
        (fake_tensor,),
        {"__module__": fake_tensor.__module__, "__qualname__": fake_tensor.__qualname__, "__doc__": fake_tensor.__doc__},
    )


@contextmanager
def real_run_view(fake_mode: Any) -> Iterator[None]:
    """While the step runs on this thread, with ``fake_mode`` the trace's fake mode: the
    program's questions about the trace get a real run's answers (see the module)."""
    tracing = get_ident()

    def reads_it(frame: FrameType) -> bool:
        return looks_it_up(frame) and is_the_program(frame, tracing)

    ours = {id(mode) for mode in private(f"{_DISPATCH}._get_current_dispatch_mode_stack")()}
    ours.add(id(fake_mode))

    def the_programs(mode: Any) -> Any:
        return None if mode is None or id(mode) in ours else mode

    real: dict[str, Callable[..., Any]] = {}

    def is_fake(x: Any) -> bool:
        return bool(real["is_fake"](x)) and real["maybe_get_fake_mode"](x) is not fake_mode

    def maybe_get_fake_mode(x: Any) -> Any:
        return the_programs(real["maybe_get_fake_mode"](x))

    def detect_fake_mode(inputs: Any = None) -> Any:
        return the_programs(real["detect_fake_mode"](inputs))

    def programs_modes() -> list[Any]:
        return [mode for mode in private(f"{_DISPATCH}._get_current_dispatch_mode_stack")() if id(mode) not in ours]

    def is_in_torch_dispatch_mode(include_infra_modes: bool = True) -> bool:
        return bool(programs_modes())

    def get_current_dispatch_mode() -> Any:
        modes = programs_modes()
        return modes[-1] if modes else None

    answers: dict[str, Any] = {
        **dict.fromkeys(FAKE_TENSOR_NAMES, never_an_instance()),
        "torch._subclasses.fake_tensor.is_fake": is_fake,
        "torch._subclasses.fake_tensor.maybe_get_fake_mode": maybe_get_fake_mode,
        "torch._guards.detect_fake_mode": detect_fake_mode,
        f"{_DISPATCH}.is_in_torch_dispatch_mode": is_in_torch_dispatch_mode,
        f"{_DISPATCH}._get_current_dispatch_mode": get_current_dispatch_mode,
    }
    with ExitStack() as stack:
        bound: dict[int, tuple[Any, Any]] = {}
        for path, answer in answers.items():
            original = stack.enter_context(replacing_for_readers(path, answer, reads_it))
            bound[id(original)] = (original, answer)
            if callable(answer) and not isinstance(answer, type):
                real[path.rpartition(".")[2]] = original
                functools.update_wrapper(answer, original)
        stack.enter_context(_bound_in_the_programs_modules(bound))
        yield


#: The modules looked at, by their names in ``sys.modules``: the module, how many globals
#: it had, and the names among them bound to an original then (none: not the program's).
#: A module is looked at again where its globals are more or fewer.
_LOOKED: dict[str, tuple[Any, int, tuple[str, ...]]] = {}
#: The names found bound to an original, (globals, name), when ``sys.modules`` held as
#: many modules as it holds now (looked at again where an import added one: a module
#: that binds such a name after its import, when no other module is imported since, is
#: not found).
_FOUND: list[tuple[dict[str, Any], str]] = []
_LOOKED_AT: list[int] = [0]
#: Each tracing thread's answers, by the id of the original they answer for.
_ANSWERS: dict[int, dict[int, Any]] = {}
#: The bindings made while traces run (globals, name, original, stand-in), and how many
#: traces run (the stages of a pipeline trace on threads of one process).
_SWAPPED: list[tuple[dict[str, Any], str, Any, Any]] = []
_RUNNING: list[int] = [0]
_LOCK: Final = threading.Lock()


@functools.cache
def _stand_in(original: Any) -> Any:
    """What a name bound to ``original`` is bound to while traces run: the class no tensor
    is an instance of, or a function that answers as the calling thread's trace does (the
    original where the thread traces nothing)."""
    if isinstance(original, type):
        return never_an_instance()

    @functools.wraps(original)
    def answer(*args: Any, **kwargs: Any) -> Any:
        return _ANSWERS.get(get_ident(), {}).get(id(original), original)(*args, **kwargs)

    return answer


@contextmanager
def _bound_in_the_programs_modules(answers: dict[int, tuple[Any, Any]]) -> Iterator[None]:
    """For the block, on this thread, the globals of the program's modules (not torch's,
    not this package's) bound to an original of ``answers`` (by id: the original and its
    answer) answer as its answer does; bound back when the last trace running ends (the
    stages of a pipeline trace on threads of one process), where the module has not
    bound them again."""
    thread = get_ident()
    with _LOCK:
        outer = _ANSWERS.get(thread)  # (a trace inside a trace on this thread: the outer's, after)
        _ANSWERS[thread] = {key: answer for key, (_, answer) in answers.items()}
        if not _RUNNING[0]:
            _bind(answers)
        _RUNNING[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            if outer is None:
                del _ANSWERS[thread]
            else:
                _ANSWERS[thread] = outer
            _RUNNING[0] -= 1
            if not _RUNNING[0]:
                for scope, name, original, stand_in in _SWAPPED:
                    if scope.get(name) is stand_in:
                        scope[name] = original
                _SWAPPED.clear()


def _bind(answers: dict[int, tuple[Any, Any]]) -> None:
    if len(sys.modules) != _LOOKED_AT[0]:
        _look(answers)
        _LOOKED_AT[0] = len(sys.modules)
    for scope, name in _FOUND:
        value = scope.get(name)
        found = answers.get(id(value))
        if found is not None and found[0] is value:
            scope[name] = stand_in = _stand_in(value)
            _SWAPPED.append((scope, name, value, stand_in))


def _look(answers: dict[int, tuple[Any, Any]]) -> None:
    """Find the names the program's modules bind to an original of ``answers``
    (:data:`_FOUND`), looking again at the modules whose globals are more or fewer since."""
    _FOUND.clear()
    for key, module in list(sys.modules.items()):
        try:  # (not through the object's __getattr__: a lazy module's may import, or raise)
            scope = object.__getattribute__(module, "__dict__")
        except AttributeError:
            continue
        if type(scope) is not dict:
            continue
        seen = _LOOKED.get(key)
        if seen is None or seen[0] is not module or seen[1] != len(scope):
            path = scope.get("__file__")  # (from its globals: a lazy module's __getattr__ may import)
            program = isinstance(path, str) and not path.startswith(NOT_THE_PROGRAM)
            names = tuple(name for name, value in list(scope.items()) if id(value) in answers) if program else ()
            seen = _LOOKED[key] = (module, len(scope), names)
        _FOUND.extend((scope, name) for name in seen[2])
