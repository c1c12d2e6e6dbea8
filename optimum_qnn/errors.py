"""The project's error types. Every failure a user can cause surfaces as a subclass of OptimumQnnError."""

from __future__ import annotations


class OptimumQnnError(Exception):
    """Base class of every error optimum-qnn raises on purpose."""


class UnsupportedModelError(OptimumQnnError, ValueError):
    """The model type or one of its features cannot be exported (yet)."""


class ContextOverflowError(OptimumQnnError, ValueError):
    """A prompt or a generation does not fit the exported context length."""


class InvalidInputError(OptimumQnnError, ValueError):
    """Token ids or arguments that the runner cannot accept."""
