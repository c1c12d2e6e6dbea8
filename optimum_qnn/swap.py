"""The generic module-swap registry.

Models register a factory per Hugging Face class; :func:`apply_swaps` walks a module tree and builds the
static replacement tree. Factories ADOPT the Hugging Face parameters (they hand the very same
``nn.Parameter`` objects to the new modules) and never mutate the source model. The registry knows no model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

logger = logging.getLogger(__name__)

Factory = Callable[[nn.Module, "SwapContext"], nn.Module]


class SwapError(RuntimeError):
    """A swap could not be applied (unregistered module left over, duplicate registration, unadopted weight)."""


@dataclass
class SwapRecord:
    path: str
    source: str
    target: str


@dataclass
class SwapReport:
    """What :func:`apply_swaps` did: each swapped module and each module passed through unchanged."""

    swapped: list[SwapRecord] = field(default_factory=list)
    passed_through: list[SwapRecord] = field(default_factory=list)

    def table(self) -> str:
        """A compact summary: one row per (source class -> target class) with its count."""
        counts: dict[tuple[str, str], int] = {}
        for rec in self.swapped + self.passed_through:
            counts[(rec.source, rec.target)] = counts.get((rec.source, rec.target), 0) + 1
        width = max((len(s) for s, _ in counts), default=10)
        lines = [f"{'Hugging Face module':<{width}}  ->  static module (count)"]
        for (src, dst), n in sorted(counts.items()):
            lines.append(f"{src:<{width}}  ->  {dst} ({n})")
        return "\n".join(lines)


class SwapRegistry:
    """Maps Hugging Face module classes (exact types, not names) to static factories."""

    def __init__(self) -> None:
        self._factories: dict[type[nn.Module], Factory] = {}
        self._passthrough: dict[type[nn.Module], str] = {}

    def register(self, hf_cls: type[nn.Module]) -> Callable[[Factory], Factory]:
        """Decorator registering ``factory(hf_module, ctx) -> nn.Module`` for ``hf_cls``. Twice raises."""

        def deco(factory: Factory) -> Factory:
            if hf_cls in self._factories or hf_cls in self._passthrough:
                raise SwapError(f"{hf_cls.__qualname__} is already registered")
            self._factories[hf_cls] = factory
            return factory

        return deco

    def pass_through(self, hf_cls: type[nn.Module], reason: str) -> None:
        """Declare that ``hf_cls`` is already static-friendly and is kept as it is."""
        if hf_cls in self._factories or hf_cls in self._passthrough:
            raise SwapError(f"{hf_cls.__qualname__} is already registered")
        self._passthrough[hf_cls] = reason

    def factory_for(self, cls: type[nn.Module]) -> Factory | None:
        return self._factories.get(cls)


    @property
    def swapped_classes(self) -> frozenset[type[nn.Module]]:
        return frozenset(self._factories)

    @property
    def passed_classes(self) -> dict[type[nn.Module], str]:
        return dict(self._passthrough)


class SwapContext:
    """Handed to every factory: swaps children (recording their paths) and carries build options."""

    def __init__(self, registry: SwapRegistry, options: Any = None, report: SwapReport | None = None, path: str = ""):
        self.registry = registry
        self.options = options
        self.report = report if report is not None else SwapReport()
        self.path = path

    def swap(self, module: nn.Module | None, name: str) -> Any:
        """Swap ``module`` (a child called ``name`` of the module being built); None stays None."""
        if module is None:
            return None
        path = f"{self.path}.{name}" if self.path else name
        cls = type(module)
        factory = self.registry.factory_for(cls)
        if factory is None:
            self.report.passed_through.append(SwapRecord(path, cls.__name__, cls.__name__))
            return module
        child_ctx = SwapContext(self.registry, self.options, self.report, path)
        new = factory(module, child_ctx)
        self.report.swapped.append(SwapRecord(path, cls.__name__, type(new).__name__))
        return new


def apply_swaps(root: nn.Module, registry: SwapRegistry, options: Any = None) -> tuple[nn.Module, SwapReport]:
    """Build the static tree for ``root``. The source model is left untouched.

    Raises:
        SwapError: if a module of a registered class survives anywhere in the result (its path is named),
            or if the root class itself has no factory.
    """
    if registry.factory_for(type(root)) is None:
        raise SwapError(f"No static replacement is registered for {type(root).__qualname__}")
    ctx = SwapContext(registry, options)
    new_root = ctx.swap(root, "")
    check_swapped(new_root, registry)
    return new_root, ctx.report


def check_swapped(root: nn.Module, registry: SwapRegistry) -> None:
    """Raise `SwapError` naming the first module under ``root`` whose class has a factory: it was left unswapped
    (for a static tree built of several swapped parts, as :func:`apply_swaps` checks its own)."""
    for path, module in root.named_modules():
        if registry.factory_for(type(module)) is not None:
            raise SwapError(f"Module '{path or '<root>'}' of class {type(module).__qualname__} was left unswapped")


# The registry every model package registers into (models/<arch>/modules.py).
SWAPS = SwapRegistry()
