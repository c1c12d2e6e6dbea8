"""The project's error types. Every failure a user can cause surfaces as a subclass of OptimumQnnError."""

from __future__ import annotations

import enum


class OptimumQnnError(Exception):
    """Base class of every error optimum-qnn raises on purpose."""


class UnsupportedModelError(OptimumQnnError, ValueError):
    """The model type or one of its features cannot be exported (yet)."""


class ContextOverflowError(OptimumQnnError, ValueError):
    """A prompt or a generation does not fit the exported context length."""


class InvalidInputError(OptimumQnnError, ValueError):
    """Token ids or arguments that the runner cannot accept."""


class UnsupportedParameterError(InvalidInputError):
    """A generation parameter that the backend running the model cannot honour (``param`` names it, ``backend``
    says which backend refused); the server answers it with a 400 naming both."""

    def __init__(self, message: str, *, param: str, backend: str):
        super().__init__(message)
        self.param, self.backend = param, backend


class UnsupportedOnSocError(OptimumQnnError, ValueError):
    """An export choice the target SoC's HTP cannot run (optimum_qnn.socs.ARCH_LIMITS)."""


class QnnCompileError(OptimumQnnError, RuntimeError):
    """QNN's HTP compiler rejected a graph the exporter made (an op it has no kernel for at that precision)."""


def parse_enum(enum_cls: type[enum.Enum], value: object, what: str):
    """The member of a string-valued enum named by `value` (any case), or a refusal listing the members."""
    if isinstance(value, enum_cls):
        return value
    for member in enum_cls:
        if str(value).strip().lower() == member.value.lower():
            return member
    raise InvalidInputError(f"Unknown {what} {value!r}; expected one of: {', '.join(m.value for m in enum_cls)}")
