"""The journal of a step function's world (``engine/user/journal.py``): what it puts back,
and what it lets go of while the step runs, as the program does."""

from __future__ import annotations

import collections
import gc
import weakref

import torch

from pytest_torchmem.engine.user.journal import Journal, checkpoint, journaling
from pytest_torchmem.engine.user.reaching import global_names, reach


class Holder:
    def __init__(self) -> None:
        self.state: dict[str, object] = {}
        self.log: list[object] = []


def test_what_the_call_wrote_is_put_back() -> None:
    holder = Holder()
    ordered = collections.OrderedDict(a=1)
    world = reach(lambda: None, (holder, ordered), {}, ["holder", "ordered"])
    journal = Journal(world.holders)
    holder.state["new"] = 1
    holder.log.append(2)
    holder.extra = 3  # type: ignore[attr-defined]
    ordered["b"] = 2
    ordered.move_to_end("a")
    journal.restore()
    assert (holder.state, holder.log, vars(holder).keys() == {"state", "log"}) == ({}, [], True)
    assert list(ordered.items()) == [("a", 1)]


def test_a_holder_the_program_drops_is_emptied_at_a_checkpoint_and_put_back_after() -> None:
    """The program replaces ``holder.state`` with a new dict (a grad scaler's ``update()``):
    in a real run the old one dies with what the step put in it. The journal holds the old
    one, to put it back; at the next checkpoint it lets go of its contents."""
    holder = Holder()
    before = id(holder.state)  # (not the dict itself: the test would hold it)
    world = reach(lambda: None, (holder,), {}, ["holder"])
    journal = Journal(world.holders)
    world.release()
    put = torch.empty(4)
    alive = weakref.ref(put)
    with journaling(journal):
        holder.state["tensor"] = put
        del put
        holder.state = {}  # the program lets go of the old dict
        checkpoint()
        gc.collect()
        assert alive() is None  # what the step put there died with it, as in a real run
        kept = holder.log
        kept.append(object())
        checkpoint()
        assert len(kept) == 1  # (a holder the program still refers to is not touched)
    journal.restore()
    assert id(holder.state) == before and holder.state == {} and holder.log == []


def test_the_globals_a_function_reads_are_those_it_loads_as_globals() -> None:
    """``trainer.opt`` reads an attribute named ``opt``, not the global ``opt``; ``mylib.X``
    reads ``X`` of the global ``mylib``."""

    def step(trainer: object) -> None:
        trainer.opt.step()  # type: ignore[attr-defined]
        collections.OrderedDict()

    names = dict(global_names(step.__code__))
    assert set(names) == {"collections"}
    assert names["collections"] == ("OrderedDict",)
