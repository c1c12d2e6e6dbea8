"""Interrupted exports and long-running generation.

- An export killed with SIGKILL (during calibration, during lowering) leaves every earlier variant and the index
  byte for byte as they were and nothing that looks like a variant; a re-run then succeeds.
- A variant write killed inside its write/swap window (the staged variant complete but not yet in place; the new
  variant swapped in but the old one not yet deleted nor the index updated) leaves the variant either exactly as it
  was or wholly replaced and verifying; the next export removes what the killed one left.
- A soak test (slow: minutes of emulator steps): 200 generate calls on one loaded model keep RSS flat and give
  the same tokens every time.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import KV_CTX, REPO_ROOT, child_env


def export_command(model: Path, out: Path, quant: str) -> list[str]:
    return [
        sys.executable, "-m", "optimum_qnn", "export", "--model", str(model), "--output", str(out), "--soc", "SM8650",
        "--quant", quant, "--mode", "kv", "--max-seq-len", str(KV_CTX), "--embedding-quant", "none" if quant == "fp16" else "8,0",
        "--verbose",
    ]


def kill_at(command: list[str], marker: str, delay: float = 0.0) -> str:
    """Run ``command``, SIGKILL it ``delay`` seconds after ``marker`` appears in its output; returns the output."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO_ROOT)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {marker!r} (exit {proc.returncode}):\n{output[-3000:]}"
    return output


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones too) -> sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_killed_exports_leave_earlier_variants_intact_and_rerun_succeeds(demo_model_dir, demo_kv_export, tmp_path):
    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.artifacts.variants import verify_files

    out = tmp_path / "out"
    shutil.copytree(demo_kv_export, out)
    before = snapshot(out)
    assert "qnn/sm8650/fp16-ctx64-kv/model.pte" in before

    # Re-exporting the same variant, killed while lowering: the old variant is replaced only by a complete one.
    kill_at(export_command(demo_model_dir, out, "fp16"), "[lower SM8650] ...", delay=3.0)
    assert snapshot(out) == before
    # A new quantized variant, killed while calibrating: no trace of it.
    kill_at(export_command(demo_model_dir, out, "16a8w"), "[calibrate] ...")
    assert snapshot(out) == before

    # Re-running the killed fp16 export succeeds (fp16, not the 16a8w one: the fast suite calibrates and lowers the
    # demo model at 16a8w once, in the CLI fixture). The variant is replaced whole, and nothing is left behind.
    rerun = subprocess.run(export_command(demo_model_dir, out, "fp16"), capture_output=True, text=True, env=child_env(), cwd=REPO_ROOT, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    index = json.loads((out / "qnn_index.json").read_text())
    assert [v["path"] for v in index["variants"]] == ["qnn/sm8650/fp16-ctx64-kv"]
    for entry in index["variants"]:
        folder = out / entry["path"]
        verify_files(folder, read_manifest(folder), root=out)
    assert not [p for p in out.rglob(".*") if p.name.startswith((".staging-", ".old-"))]
    assert not (out / "qnn" / "sm8650" / "16a8w-ctx64-kv").exists()


# Rewrites variant VARIANT of artifact folder argv[1] with a placeholder program of argv[2] bytes, through the real
# `VariantWriter` (what an export's last stage runs); the test stops it inside the window with STOP_AT_ENV.
REWRITE = r"""
import sys
from pathlib import Path
from optimum_qnn.artifacts.writer import VariantWriter
from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
from optimum_qnn.exporter.lowering import LoweredProgram
from optimum_qnn.artifacts.manifest import read_manifest
from optimum_qnn.models.gemma4.loading import LoadReport, read_text_config

out, size, source = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
variant = "qnn/sm8650/fp16-ctx64-kv"
contract = read_manifest(out / variant).runner_contract()
config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=ShapeConfig(64, 4),
                      embedding_quant=EmbeddingQuant(0, 0))
writer = VariantWriter(out, source_folder=source, model_id=str(source), revision=None,
                       load_report=LoadReport(files=["model.safetensors"]), tokenizer=None,
                       text_config=read_text_config(source))
program = LoweredProgram(program=b"\x07" * size, delegation={}, weight_sharing=False, soc=Soc.SM8650)
writer.write_variant(variant, program, contract, config)
print("written")
"""


def stop_and_kill(out: Path, source: Path, point: str) -> None:
    """Run REWRITE until it stops itself at ``point``, then SIGKILL it there."""
    import os

    from optimum_qnn.artifacts.writer import STOP_AT_ENV

    env = {**child_env(), STOP_AT_ENV: point}
    for key in ("QNN_SDK_ROOT", "OPTIMUM_QNN_CACHE"):  # the writer records the SDK build id
        if key in os.environ:
            env[key] = os.environ[key]
    proc = subprocess.Popen([sys.executable, "-c", REWRITE, str(out), "5000", str(source)], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns when the child stops (or ends)
        assert os.WIFSTOPPED(status), f"did not stop at {point}: {proc.communicate()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_inside_the_write_and_swap_window(demo_model_dir, demo_kv_export, tmp_path):
    from optimum_qnn.artifacts.writer import check_output_folder, read_index
    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.artifacts.variants import verify_files

    variant = "qnn/sm8650/fp16-ctx64-kv"
    out = tmp_path / "out"
    shutil.copytree(demo_kv_export, out)
    before = snapshot(out)

    # Staged but not swapped in: every visible file as it was; only a hidden staging folder is new.
    stop_and_kill(out, demo_model_dir, "variant-staged")
    after = snapshot(out)
    staged = {k: v for k, v in after.items() if k.startswith(".staging-")}
    assert {k: v for k, v in after.items() if k not in staged} == before
    assert any(k.endswith("/model.pte") for k in staged)
    check_output_folder(out)  # what the next export runs first
    assert snapshot(out) == before

    # Swapped in, old copy not yet deleted, index not yet rewritten: the variant is wholly the new one and verifies.
    stop_and_kill(out, demo_model_dir, "variant-swapped")
    folder = out / variant
    assert (folder / "model.pte").read_bytes() == b"\x07" * 5000
    manifest = read_manifest(folder)
    verify_files(folder, manifest, root=out)
    assert [v["path"] for v in read_index(out)["variants"]] == [variant]
    (leftover,) = [p for p in out.iterdir() if p.name.startswith(".staging-")]  # the old variant, exchanged out
    assert snapshot(leftover) == {k[len(variant) + 1 :]: v for k, v in before.items() if k.startswith(variant + "/")}
    check_output_folder(out)
    assert not [p for p in out.iterdir() if p.name.startswith(".staging-")]


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


SOAK_CALLS = 200
SOAK_RSS_GROWTH_MB = 16.0  # bound on RSS growth between call 20 and call 200


@pytest.mark.slow
def test_soak_200_generate_calls(fp16_model):
    """The demo Gemma4's hybrid fp16 export; prompt lengths cycle over 1..37 tokens (decode only, one to three
    prefill calls, the window of 16 crossed), 2 new tokens each."""
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)) for n in range(1, 38, 4)]
    first: dict[int, list[int]] = {}
    rss = []
    for call in range(SOAK_CALLS):
        prompt = prompts[call % len(prompts)]
        out = fp16_model.generate(prompt, max_new_tokens=2, eos_token_id=[])[0].tolist()
        assert first.setdefault(len(prompt), out) == out, f"call {call}: output changed for prompt length {len(prompt)}"
        rss.append(_rss_mb())
    growth = max(rss[20:]) - rss[19]
    print(f"soak: {SOAK_CALLS} calls, RSS {rss[19]:.0f} MB after 20 calls, max growth after that {growth:.1f} MB")
    assert growth <= SOAK_RSS_GROWTH_MB, f"RSS grew {growth:.1f} MB over {SOAK_CALLS - 20} calls"
