"""Environment switches (`optimum_qnn.environment`): one spelling of on and off for every variable, and a bad value
refused with the accepted ones."""

from __future__ import annotations

import pytest

from optimum_qnn.environment import env_number, env_switch
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.edge import EDGE_SIDE_BY_SIDE_VARIABLE


@pytest.mark.parametrize("text, want", [("1", True), ("on", True), ("True", True), ("YES", True), ("0", False),
                                        ("off", False), ("false", False), ("No", False), ("", True)])
def test_a_switch_reads_the_same_words_as_on_and_off(text, want, monkeypatch):
    monkeypatch.setenv(EDGE_SIDE_BY_SIDE_VARIABLE, text)
    assert env_switch(EDGE_SIDE_BY_SIDE_VARIABLE, True) is want


def test_a_bad_switch_value_lists_the_accepted_ones(monkeypatch):
    monkeypatch.setenv(EDGE_SIDE_BY_SIDE_VARIABLE, "sometimes")
    with pytest.raises(InvalidInputError, match=r"OPTIMUM_QNN_EDGE_SIDE_BY_SIDE='sometimes'.*1, on, true, yes.*0, off"):
        env_switch(EDGE_SIDE_BY_SIDE_VARIABLE, True)
    monkeypatch.delenv(EDGE_SIDE_BY_SIDE_VARIABLE)
    assert env_switch(EDGE_SIDE_BY_SIDE_VARIABLE, False) is False


def test_the_edge_lowering_reads_its_switch_when_it_runs(monkeypatch):
    """Read when `prepare` runs, not at import: `EdgeLowering.parallel_edge` None means "the variable decides"."""
    from optimum_qnn.exporter.lowering import EdgeLowering

    assert EdgeLowering.parallel_edge is None


def test_a_number_variable_refuses_what_is_not_a_number(monkeypatch):
    from optimum_qnn.artifacts.writer import LOCK_TIMEOUT_ENV

    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "ten")
    with pytest.raises(InvalidInputError, match=r"OPTIMUM_QNN_LOCK_TIMEOUT='ten' is not a number >= 0"):
        env_number(LOCK_TIMEOUT_ENV, 600)
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "2.5")
    assert env_number(LOCK_TIMEOUT_ENV, 600) == 2.5
