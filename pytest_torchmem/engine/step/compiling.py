"""The ``compile=`` option: check an eager model as ``torch.compile(model, **options)`` runs it.

``compile=True`` or a dict of ``torch.compile``'s ``mode``, ``dynamic``,
``fullgraph`` and ``options`` (issue 11). The value is read here, without
torch (the pytest plugin reads the marker's and the ini's at collection):
:func:`compile_options` gives a :class:`CompileOptions`, or None for an eager
check, or raises ``TypeError``/``ValueError`` naming the bad value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["COMPILE_KEYS", "MODES", "CompileOptions", "compile_options"]

#: The ``torch.compile`` arguments ``compile=`` takes (the backend is inductor's).
COMPILE_KEYS: Final = ("mode", "dynamic", "fullgraph", "options")
#: ``torch.compile``'s modes.
MODES: Final = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """``torch.compile``'s arguments for a check of an eager model as compiled.

    ``options`` (inductor's config, e.g. ``{"epilogue_fusion": False}``) is kept
    as its JSON text, sorted: the value is hashable and says itself in a key.
    """

    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    options: str | None = None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile``."""
        kwargs: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "mode": self.mode}
        if self.options is not None:
            kwargs["options"] = json.loads(self.options)
        return kwargs

    @property
    def key(self) -> str:
        """How a snapshot entry names a compiled check: ``"compiled"``, with the options
        given (``"compiled mode=max-autotune,dynamic=True"``)."""
        said = []
        if self.mode is not None:
            said.append(f"mode={self.mode}")
        if self.dynamic is not None:
            said.append(f"dynamic={self.dynamic}")
        if self.fullgraph:
            said.append("fullgraph=True")
        if self.options is not None:
            said.append(f"options={self.options}")
        return "compiled" + (" " + ",".join(said) if said else "")

    def __str__(self) -> str:
        return self.key


def compile_options(value: Any, where: str = "compile") -> CompileOptions | None:
    """Read ``compile=``: None or False (eager), True (``torch.compile``'s defaults), a
    dict of :data:`COMPILE_KEYS`, or a :class:`CompileOptions`; ``where`` names it in errors."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if isinstance(value, CompileOptions):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be True, False, None or a dict of torch.compile's "
            f"{', '.join(COMPILE_KEYS)}, e.g. {{'mode': 'max-autotune'}}; got {value!r}"
        )
    unknown = [key for key in value if key not in COMPILE_KEYS]
    if unknown:
        extra = (
            "; only inductor's programs are followed, so the backend is not an option"
            if "backend" in unknown
            else ""
        )
        raise ValueError(
            f"{where} does not take {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(COMPILE_KEYS)} (as torch.compile does){extra}"
        )
    mode = value.get("mode")
    if mode is not None and mode not in MODES:
        raise ValueError(f"{where}: mode {mode!r} is not one of {', '.join(MODES)}")
    dynamic = value.get("dynamic")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"{where}: dynamic must be True, False or None, got {dynamic!r}")
    fullgraph = value.get("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise TypeError(f"{where}: fullgraph must be True or False, got {fullgraph!r}")
    options = value.get("options")
    text = None
    if options is not None:
        if mode is not None:
            raise ValueError(
                f"{where} takes mode or options, not both (torch.compile refuses "
                "them together); put the mode's settings in options"
            )
        text = _options_text(options, where)
    return CompileOptions(mode=mode, dynamic=dynamic, fullgraph=fullgraph, options=text)


def _options_text(options: Any, where: str) -> str:
    """Inductor's options as sorted JSON (names, and plain values: numbers, strings, lists)."""
    if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
        raise TypeError(
            f"{where}: options must be a dict of inductor option names to values, "
            f"e.g. {{'epilogue_fusion': False}}; got {options!r}"
        )
    try:
        return json.dumps(dict(options), sort_keys=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        bad = next((k for k, v in options.items() if not _plain(v)), "?")
        raise TypeError(
            f"{where}: options[{bad!r}] is {options.get(bad)!r}; the values must be "
            "plain (bool, number, string, None, or lists and dicts of them)"
        ) from None


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
