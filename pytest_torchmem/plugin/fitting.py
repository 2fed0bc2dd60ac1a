"""``torchmem.fit(...)``: the largest size that fits, searched in a test, and gated.

A test calls ``torchmem.fit(model, inputs_for, at_least=32)``: the search of
:func:`pytest_torchmem.fit` runs on the fake cuda device against the test's GPU
(the marker's ``gpu``, else the run's; or ``gpu=``/``budget=``), a progress line
per estimate goes to the terminal, and the answer is a :class:`FitRecord`, shown in
the run's summary and JSON report. Where ``at_least`` is given and the largest size
that fits is below it, the test fails: a change that shrinks the batch a recipe
needs is caught as a regression is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_torchmem.engine.figures.units import format_bytes

__all__ = ["FitRecord", "fit_lines"]


@dataclass(frozen=True)
class FitRecord:
    """One ``torchmem.fit`` of a test: what was searched, and what fits."""

    nodeid: str
    target: str
    size_name: str
    size: int | None
    nbytes: int | None
    limit: int
    figure: str
    next_size: int | None
    next_nbytes: int | None
    estimates: int
    at_least: int | None = None

    @property
    def short(self) -> bool:
        """Below ``at_least``: the test fails."""
        return self.at_least is not None and (self.size or 0) < self.at_least

    @classmethod
    def of(cls, nodeid: str, found: Any, at_least: int | None) -> FitRecord:
        """The record of :func:`pytest_torchmem.fit`'s ``found``."""
        return cls(
            nodeid=nodeid,
            target=found.target,
            size_name=found.size_name,
            size=found.size,
            nbytes=found.nbytes,
            limit=found.limit,
            figure=found.figure,
            next_size=found.next_size,
            next_nbytes=found.next_nbytes,
            estimates=len(found.probes),
            at_least=at_least,
        )

    def line(self) -> str:
        """``test: batch 24 fits T4: 13.83 GiB reserved of 14.24 GiB; batch 25 needs 14.44 GiB
        (6 estimates); at least 16: passed``."""
        figure = "reserved" if self.figure == "reserved" else "peak"
        if self.size is None:
            found = f"no {self.size_name} fits {self.target}"
        else:
            assert self.nbytes is not None
            found = (
                f"{self.size_name} {self.size} fits {self.target}: {format_bytes(self.nbytes)} "
                f"{figure} of {format_bytes(self.limit)}"
            )
        if self.next_size is not None and self.next_nbytes is not None:
            found += f"; {self.size_name} {self.next_size} needs {format_bytes(self.next_nbytes)}"
        elif self.size is not None:
            found += f" (the largest {self.size_name} searched)"
        found += f" ({self.estimates} estimates)"
        if self.at_least is not None:
            found += f"; at least {self.at_least}: {'below' if self.short else 'passed'}"
        return f"{self.nodeid}: {found}"

    def failure(self) -> str:
        """The failure message of a test whose largest size fell below ``at_least``."""
        largest = "none" if self.size is None else str(self.size)
        return (
            f"torchmem: the largest {self.size_name} that fits {self.target} is {largest}, below "
            f"at_least={self.at_least}: {self.line().split(': ', 1)[1]}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "nodeid": self.nodeid,
            "target": self.target,
            "size_name": self.size_name,
            "size": self.size,
            "nbytes": self.nbytes,
            "limit": self.limit,
            "figure": self.figure,
            "next_size": self.next_size,
            "next_nbytes": self.next_nbytes,
            "estimates": self.estimates,
            "at_least": self.at_least,
            "short": self.short,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FitRecord:
        fields = {key: data[key] for key in cls.__dataclass_fields__ if key in data}
        return cls(**fields)


def fit_lines(records: list[FitRecord]) -> list[str]:
    """The summary's lines of the run's ``torchmem.fit`` searches."""
    return [f"fit: {record.line()}" for record in sorted(records, key=lambda record: record.nodeid)]
