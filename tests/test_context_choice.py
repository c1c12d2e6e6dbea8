"""Choosing a variant's context among an artifact's (`--max-seq-len`, `from_pretrained(context_len=...)`): with none
asked, the largest whose estimated memory fits the host's (or ``max_memory``); a context no variant has is refused
with the contexts there are. The folder is tests/conftest.py `layouts_export` (contexts 64 and 128, full and ring)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from optimum_qnn.artifacts.manifest import read_manifest
from optimum_qnn.artifacts.variants import VariantNotFoundError, memory_need_bytes
from optimum_qnn.host_memory import GB_BYTES
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from tests.conftest import run_main


def _need(folder: Path, name: str) -> int:
    return memory_need_bytes(read_manifest(folder / "qnn" / "sm8650" / name))


def test_the_memory_need_counts_the_program_and_every_call_tensor(layouts_export: Path) -> None:
    manifest = read_manifest(layouts_export / "qnn/sm8650/fp16-ctx128-kv")
    (method,) = manifest.contract.methods  # kv mode: the decode method only
    caches = [t for t in method.inputs if t.name.startswith(("k_cache_", "v_cache_"))]
    cache_bytes = sum(4 * t.shape[1] * t.shape[2] * t.shape[3] for t in caches)  # float32 IO
    assert _need(layouts_export, "fp16-ctx128-kv") > manifest.program.size + cache_bytes
    # Longer caches need more; the ring's sliding layers keep 7 slots where the full layout keeps 127.
    need64, need128, ring128 = (_need(layouts_export, n) for n in ("fp16-ctx64-kv", "fp16-ctx128-kv", "fp16-ctx128-ring-kv"))
    print(f"estimated need: ctx64 {need64} B, ctx128 {need128} B, ctx128 ring {ring128} B")
    assert need64 < need128 and ring128 < need128


def test_no_context_asked_takes_the_largest_that_fits(layouts_export: Path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="optimum_qnn.stages"):
        model = QNNModelForCausalLM.from_pretrained(layouts_export, cache_layout="full")
    assert model.variant.name == "fp16-ctx128-kv" and model.contract.context_len == 128
    (line,) = [r.getMessage() for r in caplog.records if r.name == "optimum_qnn.stages"]
    assert line.startswith("Context 128: the largest of this artifact's (128, 64) whose estimated ") and "less a margin" in line
    # On the host without a layout: the ring of the largest context.
    assert QNNModelForCausalLM.from_pretrained(layouts_export).variant.name == "fp16-ctx128-ring-kv"


def test_a_memory_limit_that_holds_only_the_smaller_context_takes_it(layouts_export: Path, caplog) -> None:
    need64, need128 = _need(layouts_export, "fp16-ctx64-kv"), _need(layouts_export, "fp16-ctx128-kv")
    between = (need64 + need128) / 2 / GB_BYTES
    caplog.set_level(logging.INFO, logger="optimum_qnn.stages")
    model = QNNModelForCausalLM.from_pretrained(layouts_export, cache_layout="full", max_memory=between)
    assert model.variant.name == "fp16-ctx64-kv"
    assert any(r.getMessage().startswith("Context 64: the largest of this artifact's (128, 64)")
               and "(max_memory)" in r.getMessage() for r in caplog.records)
    # Nothing fits: the smallest, with a warning that says so.
    caplog.clear()
    model = QNNModelForCausalLM.from_pretrained(layouts_export, cache_layout="full", max_memory=need64 / 2 / GB_BYTES)
    assert model.variant.name == "fp16-ctx64-kv"
    assert [r.levelno for r in caplog.records if "No context of this artifact (128, 64) fits" in r.getMessage()] == [
        logging.WARNING]


def test_a_context_no_variant_has_is_refused_with_the_contexts_there_are(layouts_export: Path, capsys) -> None:
    with pytest.raises(VariantNotFoundError, match=r"No variant has a context of 48 tokens \(--max-seq-len\); the "
                                                   r"contexts there are: 64, 128\."):
        QNNModelForCausalLM.from_pretrained(layouts_export, context_len=48)
    for command in ("chat", "serve"):
        code, out, err = run_main([command, layouts_export, "--max-seq-len", "48"], capsys)
        assert code == 2 and "the contexts there are: 64, 128." in err, err
    code, out, err = run_main(["chat", layouts_export, "--max-memory", "0"], capsys)
    assert code == 2 and "--max-memory must be a positive number of GB" in err, err


def test_the_run_command_takes_the_flags(layouts_export: Path, capfd) -> None:
    """The notice goes to the terminal's stderr (file descriptor 2) while the libraries' output is held back."""
    need64, need128 = _need(layouts_export, "fp16-ctx64-kv"), _need(layouts_export, "fp16-ctx128-kv")
    between = f"{(need64 + need128) / 2 / GB_BYTES:.9f}"
    code, out, err = run_main(["run", layouts_export, "--max-memory", between, "--cache-layout", "full",
                               "--prompt-ids", "5,6,7", "--max-new-tokens", "2"], capfd)
    assert code == 0, err
    assert "Context 64: the largest of this artifact's (128, 64)" in err
    code, out, err = run_main(["run", layouts_export, "--max-seq-len", "128", "--cache-layout", "ring",
                               "--prompt-ids", "5,6,7", "--max-new-tokens", "2"], capfd)
    assert code == 0 and "Context" not in err, err
