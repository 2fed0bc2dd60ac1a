"""The contexts a traced step runs in, as each device declares them: named, ordered, and why in that order.

A trace runs the step inside a stack of contexts: the watch of compiled
regions, the stand-ins in the model's slots, the module hooks, the fake
process group, the fake mode, the tracker, the device's router, ... Their
order matters, and it is written here: each device lists its layers, outermost
first (:data:`CPU_LAYERS`, :data:`CUDA_LAYERS`, the ``layers`` of its
:class:`~pytest_torchmem.engine.tracing.devices.DeviceModel`), each layer says
why it sits where it does (:attr:`Layer.why`), and :func:`entered` enters them
in that order and leaves them in the reverse one, however the step ends: the
one place where they are entered and left. Each is entered once per trace: the
step's ops pay nothing for them.

The order follows four rules:

1. The watch of compiled regions is outermost: first in, last out, around
   everything the other layers do.
2. What is made of real tensors comes before the fake mode (the fake process
   group's mesh).
3. The fake mode comes before the tracker: a dispatch mode entered later sits
   above it on the mode stack, and the tracker must see each op first and hand
   it to the fake mode below.
4. What changes what the program sees or calls (the router, the routed
   unpacking, the RNG state copies, a real run's answers, the GPU view, the
   beam search's stop)
   comes after the tracker: it is on only while the step (and ``apply``) runs,
   and whatever the program makes under it is fake and charged. The layers
   outside it are entered and left with torch answering as it does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from pytest_torchmem.engine.step.holdings import lend
from pytest_torchmem.engine.parallel.mesh import fake_world
from pytest_torchmem.engine.tracing.compiled import watch_compiled
from pytest_torchmem.engine.tracing.devices.cuda.gpu_view import generator_states_on_this_thread, gpu_view
from pytest_torchmem.engine.tracing.devices.cuda.streams import GpuStreams
from pytest_torchmem.engine.tracing.devices.routing import routed_unpacking
from pytest_torchmem.engine.tracing.generation import beams_run_on
from pytest_torchmem.engine.tracing.imports import imports_outside_the_step
from pytest_torchmem.engine.tracing.module_methods import module_methods_on_fakes
from pytest_torchmem.engine.tracing.real_run_view import real_run_view
from pytest_torchmem.engine.tracing.rng_states import charged_rng_states

if TYPE_CHECKING:
    from torch import nn

    from pytest_torchmem.engine.step.holdings import Holdings
    from pytest_torchmem.engine.user.model_state import Converted
    from pytest_torchmem.engine.parallel.mesh import Parallel
    from pytest_torchmem.engine.tracing.compiled_program import Following
    from pytest_torchmem.engine.tracing.tracker import Tracker

__all__ = [
    "BEAMS_RUN_ON",
    "BLOCK_REPLAY",
    "CPU_LAYERS",
    "CUDA_LAYERS",
    "FAKE_MODE",
    "FAKE_WORLD",
    "GPU_VIEW",
    "IMPORTS",
    "Layer",
    "MODULE_HOOKS",
    "MODULE_METHODS",
    "RNG_STATES",
    "REAL_RUN_VIEW",
    "ROUTED_UNPACKING",
    "ROUTER",
    "STAND_INS",
    "Scene",
    "TRACKER",
    "WARM_UP_LAYERS",
    "WATCH_COMPILED",
    "entered",
]


@dataclass
class Scene:
    """What the layers of one trace are made of, made by the trace before it enters them."""

    #: What the step holds of the user's: the model's tensors, or a step function's world.
    holdings: Holdings
    #: The stand-ins the model (or the world) holds during the step (:func:`lend`).
    standins: Converted
    #: The model the step runs (a copy holding the stand-ins under ``parallel=``).
    step_model: nn.Module
    fake_mode: Any
    #: The compiled regions the trace follows (their redirect, for the watch).
    following: Following
    tracker: Tracker | None = None
    #: The per-module hooks (a ModuleTracker), or a stand-in with none (NoModules).
    modules: Any = None
    #: The device's router as the step enters it, and the router itself (which the
    #: routed recomputation re-enters); None where the step is not routed.
    router: Any = None
    routing: Any = None
    parallel: Parallel | None = None
    rank: int = 0
    #: The GPU profile the fake cuda device's view answers as.
    gpu: Any = None
    #: The caching allocator's statistics so far, as the GPU view answers the program
    #: (cuda/memory_stats.py), or None.
    memory: Any = None
    #: The replay of the model's repeated blocks (block_replay.py), or None.
    blocks: Any = None
    #: What each layer's context gave on entry, by the layer's name (the fake world's mesh).
    entered: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Layer:
    """One context of a traced step: its name, why it sits where it does in its
    device's list, and how a trace makes it from its :class:`Scene` (None: not in
    this trace)."""

    name: str
    why: str
    make: Callable[[Scene], AbstractContextManager[Any] | None]


@contextmanager
def entered(layers: Sequence[Layer], scene: Scene) -> Iterator[dict[str, Any]]:
    """Enter ``layers`` in order (the first one outermost), each made when its turn
    comes; leave them in the reverse order however the block ends. Yields what each
    layer's context gave, by name (also :attr:`Scene.entered`)."""
    with ExitStack() as stack:
        for layer in layers:
            context = layer.make(scene)
            if context is not None:
                scene.entered[layer.name] = stack.enter_context(context)
        yield scene.entered


def _tracker(scene: Scene) -> Tracker:
    if scene.tracker is None:
        raise ValueError("this layer needs the scene's tracker")
    return scene.tracker


def _stand_ins(scene: Scene) -> AbstractContextManager[None] | None:
    if scene.parallel is not None:
        return None  # the copy apply parallelizes holds the stand-ins itself
    return lend(scene.holdings, scene.standins, compiled=scene.following.active)


def _fake_world(scene: Scene) -> AbstractContextManager[Any] | None:
    if scene.parallel is None:
        return None
    tracker = _tracker(scene)
    return fake_world(
        scene.parallel, scene.rank, tracker.device.type, tracker.storage_resized, tracker.charge_to
    )


WATCH_COMPILED: Final = Layer(
    "watch compiled regions",
    "outermost (first in, last out): it replaces dynamo's entry (on the tracing thread: a "
    "pipeline's stages are traced on threads of one process, each with its own watch), so "
    "it covers everything the other layers do on entry and exit, and the step; the model "
    "never holds stand-ins, nor is a fake mode or the tracker active, while a compiled region "
    "could reach dynamo unwatched. Regions not followed run without dynamo: left to dynamo "
    "under the tracer's dispatch mode, it skips their frames and marks the code skipped for "
    "good (seen: every later real call of a compiled torch.nn module eager)",
    lambda scene: watch_compiled(_tracker(scene).compiled_region, scene.following.redirect),
)
IMPORTS: Final = Layer(
    "imports outside the step",
    "inside the watch, outside every other layer: a module the step imports runs its own "
    "code with no mode and the machine's own devices (imports.py), whatever is on inside",
    lambda scene: imports_outside_the_step(),
)
STAND_INS: Final = Layer(
    "stand-ins in the model",
    "inside the watch (see there); it only swaps the model's references to its tensors, so "
    "it needs no mode, and the originals are back once every layer inside it has left. "
    "Without parallel= only: apply's copy of the model holds the stand-ins itself",
    _stand_ins,
)
MODULE_HOOKS: Final = Layer(
    "module hooks",
    "global forward hooks that tell the tracker which module runs; registered and removed "
    "without a tensor, so their place among the layers before the fake mode is free; none "
    "in a step that "
    "runs programs compiled in a warm-up (dynamo guards on hooks: its compiled code would "
    "not run)",
    lambda scene: scene.modules,
)
FAKE_WORLD: Final = Layer(
    "fake process group",
    "before the fake mode and the tracker: the process group and its device mesh are made "
    "of real tensors, untracked; apply runs inside every layer, its tensors fake and charged. "
    "With parallel= only",
    _fake_world,
)
FAKE_MODE: Final = Layer(
    "fake mode",
    "before the tracker: a dispatch mode entered later sits above it on the mode stack, and "
    "the fake mode must be the one below the tracker that runs each op on fake tensors",
    lambda scene: scene.fake_mode,
)
TRACKER: Final = Layer(
    "tracker",
    "after the fake mode, so that it sees each op first and records its storages; before "
    "every layer that changes what the program sees or calls, so that what the program "
    "makes under them is fake and charged",
    _tracker,
)
MODULE_METHODS: Final = Layer(
    "module methods on fake tensors",
    "after the tracker: a module's .to(), casts and deepcopy, made to act on fake tensors as "
    "on real ones, make fake tensors the tracker charges; on the tracing thread only, while "
    "the step runs",
    lambda scene: module_methods_on_fakes(),
)
ROUTER: Final = Layer(
    "router",
    "after the fake mode and the tracker: the torch-function mode that picks the device's "
    "kernels makes tensors as it routes (factories on the trace device, the kernels' own "
    "ops), which must be fake and charged; its place on the torch-function stack is the top "
    "(a followed compiled optimizer step has it step aside)",
    lambda scene: scene.router,
)
ROUTED_UNPACKING: Final = Layer(
    "routed unpacking",
    "after the router: backward's unpack hooks (a checkpoint's recomputation, the "
    "program's saved-tensor hooks) re-enter the router, so it is on only while the router is",
    lambda scene: routed_unpacking(scene.routing) if scene.routing is not None else None,
)
RNG_STATES: Final = Layer(
    "charged RNG states",
    "after the fake mode and the tracker: the CPU generator's state copies a checkpoint "
    "keeps are made as fake tensors, charged as the CPU allocator sees them",
    lambda scene: charged_rng_states(),
)
REAL_RUN_VIEW: Final = Layer(
    "a real run's answers",
    "after the fake mode, the tracker and the router, whose modes it tells from the "
    "program's: on only while the step runs, on the tracing thread, the program's "
    "questions whether it is traced (a FakeTensor, a fake or dispatch mode) get a real "
    "run's answers, and every layer outside it is entered and left with torch answering "
    "as it does",
    lambda scene: real_run_view(scene.fake_mode),
)
GPU_VIEW: Final = Layer(
    "GPU view",
    "after the tracker and the router: on only while the step runs, on the tracing thread, "
    "so that every layer outside it is entered and left with the devices as they are, and "
    "what the program makes on 'cuda' once it sees one is placed by the router",
    lambda scene: (
        gpu_view(scene.gpu, GpuStreams(_tracker(scene).charge_to), scene.memory) if scene.gpu is not None else None
    ),
)
BLOCK_REPLAY: Final = Layer(
    "block replay",
    "after the tracker, the router and the module hooks: it sets the forwards of the "
    "model's repeated blocks for the step only, its replayed events land on the tracker's "
    "timeline, and it replays the module hooks' events of the blocks' inner modules; it "
    "runs with torch-function modes off, so the router never sees a replay",
    lambda scene: scene.blocks,
)
BEAMS_RUN_ON: Final = Layer(
    "beams run on",
    "innermost: a beam search of transformers whose stop the trace cannot decide goes on "
    "(it reads the tracker's known values), in the step only",
    lambda scene: beams_run_on(_tracker(scene), scene.step_model),
)

#: The fake cpu device's layers, outermost first.
CPU_LAYERS: Final = (
    WATCH_COMPILED,
    IMPORTS,
    STAND_INS,
    MODULE_HOOKS,
    FAKE_WORLD,
    FAKE_MODE,
    TRACKER,
    MODULE_METHODS,
    ROUTER,
    ROUTED_UNPACKING,
    RNG_STATES,
    REAL_RUN_VIEW,
    BLOCK_REPLAY,
    BEAMS_RUN_ON,
)
#: The fake cuda device's layers, outermost first: as cpu's, with the GPU view where cpu
#: has its RNG state copies (the CPU generator's state a checkpoint copies out is host
#: memory, which the cuda device does not count).
CUDA_LAYERS: Final = (
    WATCH_COMPILED,
    IMPORTS,
    STAND_INS,
    MODULE_HOOKS,
    FAKE_WORLD,
    FAKE_MODE,
    TRACKER,
    MODULE_METHODS,
    ROUTER,
    ROUTED_UNPACKING,
    REAL_RUN_VIEW,
    GPU_VIEW,
    BLOCK_REPLAY,
    BEAMS_RUN_ON,
)

#: The layers of the warm-up step in which the followed compiled programs are built
#: (trace._warm_up), outermost first: the watch (it redirects the regions the trace
#: follows, and runs the others eagerly, unflagged: the traced step flags them), the
#: warm-up's own stand-ins, the rank's fake process group (under parallel=: apply runs in
#: the warm-up too), the fake mode and a tracker of the warm-up's own (the values the
#: traced step knows: the program takes the branches it takes in the traced step).
#: No GPU view: dynamo, compiling here, reads torch's own device functions; but a
#: pipeline's ranks on the fake cuda device are answered the GPU generator's state (their
#: stages' set-up saves and restores it).
WARM_UP_LAYERS: Final = (
    Layer(
        "watch compiled regions, unflagged",
        WATCH_COMPILED.why,
        lambda scene: watch_compiled(lambda name, location: None, scene.following.redirect),
    ),
    IMPORTS,
    Layer(
        "the warm-up's stand-ins in the model",
        STAND_INS.why,
        lambda scene: lend(scene.holdings, scene.standins, compiled=True),
    ),
    FAKE_WORLD,
    FAKE_MODE,
    TRACKER,
    MODULE_METHODS,
    REAL_RUN_VIEW,
    Layer(
        "the GPU generator's state",
        "innermost, in the step only: a pipeline's stages on the fake cuda device save and "
        "restore the GPU generator's state as they set up (torch.random.fork_rng), answered "
        "as the GPU view answers it in the traced step",
        lambda scene: (
            generator_states_on_this_thread()
            if scene.parallel is not None and scene.parallel.pipelined and _tracker(scene).device.type == "meta"
            else None
        ),
    ),
)
