"""SoCs of one export lowered side by side (`optimum_qnn.exporter.side_by_side`): how many at once, and that they
make what one SoC after the other makes."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from optimum_qnn.config import Soc
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.side_by_side import SOCS_SIDE_BY_SIDE_VARIABLE, socs_at_once, wave_sizes
from tests.test_lowering import CONSTANTS, attention, hybrid_inputs  # noqa: F401 - fixtures


def test_socs_at_once_counts_cores_memory_and_the_variable(monkeypatch):
    monkeypatch.delenv(SOCS_SIDE_BY_SIDE_VARIABLE, raising=False)
    assert socs_at_once(4, 6.0, 21.0, cores=2) == 3  # the memory: three whole lowerings fit 21 GB
    assert socs_at_once(4, 2.0, 21.0, cores=1) == 2  # the cores: two lowerings per core
    assert socs_at_once(8, 2.0, 21.0, cores=2) == 4
    assert socs_at_once(2, 6.0, 21.0, cores=8) == 2  # the SoCs
    assert socs_at_once(4, 12.4, 14.1, cores=2) == 1  # a full-size Gemma-4-E2B in 16 GB: one at a time
    assert socs_at_once(4, 6.0, None, cores=2) == 1  # memory unknown: one at a time
    assert socs_at_once(1, 6.0, 21.0, cores=2) == 1
    # The variable is an on/off switch spelled as every switch is (environment.switch_value), or a cap >= 2.
    for off in ("0", "off", "False", "no"):
        assert socs_at_once(4, 6.0, 21.0, cores=2, variable=off) == 1
    for on in ("1", "on", "TRUE", "yes", ""):
        assert socs_at_once(4, 6.0, 21.0, cores=2, variable=on) == 3
    assert socs_at_once(4, 6.0, 21.0, cores=2, variable="2") == 2
    monkeypatch.setenv(SOCS_SIDE_BY_SIDE_VARIABLE, "off")
    assert socs_at_once(4, 6.0, 21.0, cores=2) == 1
    monkeypatch.setenv(SOCS_SIDE_BY_SIDE_VARIABLE, "two")
    with pytest.raises(InvalidInputError, match=r"OPTIMUM_QNN_SOCS_SIDE_BY_SIDE='two'.*expected off .*0, off, false, no"):
        socs_at_once(4, 6.0, 21.0, cores=2)


def test_waves_are_as_even_as_they_can_be():
    assert wave_sizes(4, 3) == [2, 2]  # not 3 + 1: the last lowering would run alone on one core
    assert wave_sizes(3, 3) == [3] and wave_sizes(4, 4) == [4] and wave_sizes(4, 2) == [2, 2]
    assert wave_sizes(5, 3) == [3, 2] and wave_sizes(7, 3) == [3, 2, 2] and wave_sizes(3, 1) == [1, 1, 1]
    assert wave_sizes(1, 2) == [1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="lowerings side by side fork on Linux only")
def test_socs_lowered_side_by_side_make_what_one_after_the_other_makes(qnn_sdk, attention, hybrid_inputs, tmp_path,
                                                                        monkeypatch):
    """Two SoCs lowered at once (`side_by_side.lower_side_by_side`, a forked child each) make the programs the
    one-after-the-other path makes, each child's progress reaches its own part of the display, and a wave whose
    lowering fails stops its other lowering and leaves no program file."""
    from optimum_qnn.artifacts.inspection.pte import normalized_program
    from optimum_qnn.exporter import lowering, parallel_compile, side_by_side
    from optimum_qnn.exporter.side_by_side import lower_side_by_side

    programs = {name: torch.export.export(attention, inputs, strict=True) for name, inputs in hybrid_inputs.items()}
    shared = lowering.EdgeLowering(programs, fp16=True, constant_methods=CONSTANTS)
    socs = [Soc.SM8550, Soc.SM8750]
    alone = {soc: shared.lower(soc, weight_sharing=False) for soc in socs}  # keep=True: a child each, in turn
    files = iter(tmp_path / f"{i}.pte" for i in range(10))
    waves, stages = [], []

    @contextlib.contextmanager
    def stage(name):
        stages.append(name)
        yield

    seen = []
    real_progress = side_by_side.side_by_side_progress

    @contextlib.contextmanager
    def recording(descs, rss_mb=None):  # each part's records, as its child sent them
        with real_progress(descs, rss_mb) as parts:
            for part in parts:
                part.take = lambda record, take=part.take, desc=part.desc: (seen.append((desc, record.getMessage())), take(record))[1]
            yield parts

    monkeypatch.setattr(side_by_side, "side_by_side_progress", recording)
    lower_side_by_side(shared, socs, 2, weight_sharing=False, budget_gb=None, program_file=lambda: next(files),
                       lowered=waves.append, stage=stage)
    for desc in ("Lowering for SM8550", "SM8750"):
        assert (desc, "Lowering step: serializing the program") in seen, seen
    assert stages == ["lower SM8550+SM8750"] and [[soc for soc, _, _ in wave] for wave in waves] == [socs]
    for soc, lowered, seconds in waves[0]:
        assert seconds > 0 and lowered.soc is soc and lowered.delegation == alone[soc].delegation
        assert normalized_program(Path(lowered.program).read_bytes()) == normalized_program(alone[soc].buffer)
    assert normalized_program(alone[Soc.SM8550].buffer) != normalized_program(alone[Soc.SM8750].buffer)

    real = lowering.compile_specs

    def fail_for_sm8750(soc, **kwargs):
        if soc is Soc.SM8750:
            raise RuntimeError("refused for SM8750")
        return real(soc, **kwargs)

    for path in tmp_path.glob("*.pte"):
        path.unlink()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(lowering, "compile_specs", fail_for_sm8750)
        with pytest.raises(RuntimeError, match="refused for SM8750"):
            lower_side_by_side(shared, socs, 2, weight_sharing=False, budget_gb=None, program_file=lambda: next(files),
                               lowered=waves.append, stage=stage)
    assert len(waves) == 1 and not list(tmp_path.glob("*.pte"))  # nothing written, no file left
    assert not parallel_compile._live  # both children reaped


@pytest.mark.skipif(not hasattr(os, "fork"), reason="lowerings side by side fork on Linux only")
def test_an_export_for_two_socs_lowers_them_side_by_side(random_model_dir, tmp_path, monkeypatch, qnn_sdk):
    """The export's one stage for the wave (its wall time and peak), a variant per SoC compiled for that SoC, and
    no staging file left."""
    from optimum_qnn.artifacts.inspection.pte import qnn_delegates
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig
    from optimum_qnn.exporter import pipeline, side_by_side

    monkeypatch.setattr(side_by_side, "default_workers", lambda: 2)  # two cores, whatever this machine has
    monkeypatch.delenv(SOCS_SIDE_BY_SIDE_VARIABLE, raising=False)
    config = ExportConfig(socs=(Soc.SM8550, Soc.SM8750), quant=QuantScheme.FP16, mode=ExportMode.KV,
                          shapes=ShapeConfig(32, 4), embedding_quant=EmbeddingQuant(0, 0), max_memory=20)
    result = pipeline.export(random_model_dir, tmp_path / "out", config)
    names = [stage.name for stage in result.stages]
    assert "lower SM8550+SM8750" in names and not {"lower SM8550", "lower SM8750"} & set(names), names
    assert names.index("lower SM8550+SM8750") < names.index("write SM8550") < names.index("write SM8750")
    assert sorted(result.delegation) == ["SM8550", "SM8750"] and len(result.variants) == 2
    for soc, variant in zip(config.socs, result.variants):
        (delegate,) = qnn_delegates((variant / "model.pte").read_bytes())
        assert delegate.targets == {(soc.value, soc.htp_arch)}
    assert not [p for p in (tmp_path / "out").rglob("*") if p.suffix == ".pte" and p.name != "model.pte"]
