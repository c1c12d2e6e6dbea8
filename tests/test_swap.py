"""The generic swap registry."""

from __future__ import annotations

import pytest
from torch import nn

from optimum_qnn.swap import SwapError, SwapRegistry, apply_swaps


class Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Leaf()
        self.b = nn.ReLU()


class StaticLeaf(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin


class StaticRoot(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b


def test_registering_twice_raises():
    reg = SwapRegistry()
    reg.register(Leaf)(lambda m, ctx: m)
    with pytest.raises(SwapError, match="Leaf is already registered"):
        reg.register(Leaf)(lambda m, ctx: m)
    with pytest.raises(SwapError, match="already registered"):
        reg.pass_through(Leaf, "x")


def test_apply_swaps_adopts_and_reports():
    reg = SwapRegistry()
    reg.register(Leaf)(lambda m, ctx: StaticLeaf(m.lin))
    reg.register(Root)(lambda m, ctx: StaticRoot(ctx.swap(m.a, "a"), ctx.swap(m.b, "b")))
    root = Root()
    new, report = apply_swaps(root, reg)
    assert isinstance(new.a, StaticLeaf) and new.a.lin is root.a.lin
    assert isinstance(root.a, Leaf), "the source model is left untouched"
    assert [(r.path, r.source, r.target) for r in report.swapped] == [("a", "Leaf", "StaticLeaf"), ("", "Root", "StaticRoot")]
    assert [(r.path, r.source) for r in report.passed_through] == [("b", "ReLU")]
    assert "Leaf" in report.table()


def test_leftover_registered_module_names_its_path():
    reg = SwapRegistry()
    reg.register(Leaf)(lambda m, ctx: StaticLeaf(m.lin))
    # A buggy root factory that keeps the Hugging Face child instead of swapping it.
    reg.register(Root)(lambda m, ctx: StaticRoot(m.a, m.b))
    with pytest.raises(SwapError, match="Module 'a' of class Leaf was left unswapped"):
        apply_swaps(Root(), reg)


def test_unregistered_root_raises():
    with pytest.raises(SwapError, match="No static replacement is registered for Root"):
        apply_swaps(Root(), SwapRegistry())
