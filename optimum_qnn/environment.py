"""Environment variables that change what optimum-qnn does, read through one spelling.

Why one place: ``OPTIMUM_QNN_EDGE_SIDE_BY_SIDE=0`` meant "off" while ``OPTIMUM_QNN_SOCS_SIDE_BY_SIDE=1`` meant "off"
too, and a bad value of one was a bare ``ValueError``. Every on/off switch is now read by `env_switch` (the same
words mean on and off everywhere, any case) and every number by `env_number`; a value that is neither is refused
with the variable's name and the values it accepts.
"""

from __future__ import annotations

import math
import os

from optimum_qnn.errors import InvalidInputError

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


def switch_value(name: str, text: str | None, default: bool) -> bool:
    """``text`` (a variable's value) as on/off; empty or None gives ``default``."""
    if text is None or not text.strip():
        return default
    word = text.strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    raise InvalidInputError(
        f"{name}={text!r} is not an on/off value; expected one of: {', '.join(ON)} (on) or {', '.join(OFF)} (off)"
    )


def env_switch(name: str, default: bool) -> bool:
    """The on/off switch ``name`` of the environment, read now (not at import: a test or a caller may set it)."""
    return switch_value(name, os.environ.get(name), default)


def env_number(name: str, default: float, *, minimum: float = 0.0) -> float:
    """The number ``name`` of the environment (``default`` when unset or empty), at least ``minimum``."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum:
        raise InvalidInputError(f"{name}={text!r} is not a number >= {minimum:g}; expected e.g. {name}={default:g}")
    return value
