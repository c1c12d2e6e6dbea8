"""Interrupted exports and long-running generation.

- An export killed with SIGKILL (during calibration, during lowering) leaves every earlier variant and the index
  byte for byte as they were and nothing that looks like a variant; a re-run then succeeds.
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
    from optimum_qnn.manifest import read_manifest
    from optimum_qnn.modeling import verify_files

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

    rerun = subprocess.run(export_command(demo_model_dir, out, "16a8w"), capture_output=True, text=True, env=child_env(), cwd=REPO_ROOT, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    index = json.loads((out / "qnn_index.json").read_text())
    assert [v["path"] for v in index["variants"]] == ["qnn/sm8650/16a8w-ctx64-kv", "qnn/sm8650/fp16-ctx64-kv"]
    for entry in index["variants"]:
        folder = out / entry["path"]
        verify_files(folder, read_manifest(folder))
    assert not [p for p in out.rglob(".*") if p.name.startswith((".staging-", ".old-"))]
    after = snapshot(out)
    assert {k: v for k, v in after.items() if k.startswith("qnn/sm8650/fp16")} == {
        k: v for k, v in before.items() if k.startswith("qnn/sm8650/fp16")
    }


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
