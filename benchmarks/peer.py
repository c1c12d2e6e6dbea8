"""The nearest peer that runs here: optimum-executorch 1.1's XNNPACK export, beside ours, on the same model.

optimum-executorch 1.1.0 pins transformers 5.0.0rc1 (which has no Gemma4), so it is installed with `--no-deps`
into its own folder (`benchmarks/.peer/`, ignored by git) with accelerate, which it needs and runs on this project's stack through PYTHONPATH.
Both exporters run as fresh `optimum-cli` processes; wall time and peak RSS are the whole process's (import
included; VmHWM, see peak_rss.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PEER = "optimum-executorch==1.1.0"
# It loads models with a device_map, which transformers hands to accelerate.
PEER_EXTRAS = ["accelerate==1.15.0"]
PEER_DIR = Path(__file__).resolve().parent / ".peer" / PEER.replace("==", "-")


@dataclass
class ProcessCost:
    wall_s: float
    peak_rss_mb: float
    returncode: int
    log: str


def measure(module_args: list[str], *, env: dict[str, str] | None = None, log: Path) -> ProcessCost:
    """Run `python -m <module_args>` with its output to `log`: its wall time and its own peak RSS (VmHWM)."""
    peak_file = log.with_suffix(".peak")
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "peak_rss.py"), str(peak_file), "-m", *module_args]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    peak = float(peak_file.read_text()) if peak_file.is_file() else float("nan")
    return ProcessCost(time.perf_counter() - t0, peak, code, str(log))


def install_peer() -> Path:
    """pip install --no-deps the peer into its own folder (once)."""
    if not (PEER_DIR / "optimum" / "exporters" / "executorch").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(PEER_DIR), PEER, *PEER_EXTRAS],
            check=True,
        )
    return PEER_DIR


def peer_export(model_dir: Path, out: Path, log: Path, max_seq_len: int) -> ProcessCost:
    """`optimum-cli export executorch --recipe xnnpack` of `model_dir` (fp32 weights, one token per call)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(install_peer()), os.environ.get("PYTHONPATH")])))
    cmd = [
        "optimum.commands.optimum_cli", "export", "executorch", "--model", str(model_dir),
        "--task", "text-generation", "--recipe", "xnnpack", "--output_dir", str(out), "--max_seq_len", str(max_seq_len),
    ]
    return measure(cmd, env=env, log=log)


def our_export(model_dir: Path, out: Path, log: Path, *args: str) -> ProcessCost:
    """`optimum-cli export qnn` of `model_dir` with extra CLI `args`."""
    cmd = ["optimum.commands.optimum_cli", "export", "qnn", "--model", str(model_dir),
           "--output", str(out), *args]
    return measure(cmd, log=log)


def build_shared_model(folder: Path, demo_dir: Path) -> Path:
    """The demo Gemma4 with one head layout on every layer, which the peer can export, and the demo's tokenizer.

    optimum-executorch sizes its KV cache from the global `num_key_value_heads` / `head_dim`, which transformers
    refuses to give for the demo config (its full layers have 1 KV head of 64, its sliding layers 2 of 32). So the
    side by side runs on the demo config with `global_head_dim = head_dim` and the same KV heads everywhere (every
    other trait on), with random weights: export cost does not depend on what the weights are.
    """
    import shutil

    import torch
    from transformers import Gemma4ForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import tiny_gemma4

    stamp = folder / "recipe.json"
    recipe = {"version": 1, "demo_recipe": tiny_gemma4.RECIPE_VERSION}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return folder
    demo = tiny_gemma4.demo_config()
    kwargs = {k: v for k, v in demo.to_dict().items() if k != "per_layer_config"}
    head_dim = demo.per_layer_config[0].head_dim
    kwargs.update(head_dim=head_dim, global_head_dim=head_dim, num_global_key_value_heads=None, attention_k_eq_v=False)
    config = type(demo)(**kwargs)
    torch.manual_seed(0)
    Gemma4ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (demo_dir / name).is_file():
            shutil.copy(demo_dir / name, folder / name)
    stamp.write_text(json.dumps(recipe))
    return folder
