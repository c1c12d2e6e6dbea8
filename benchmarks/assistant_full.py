"""Full-size Gemma-4-E2B exported with an assistant drafter: the drafter's size and the export's time in a row.

No Gemma 4 assistant checkpoint or config is reachable where this runs (no Hub), and transformers' own
`Gemma4AssistantConfig()` defaults do not build. The drafter is built from what is published about
google/gemma-4-E2B-it-assistant: a width of 256 (its centroid layer is `Linear(256, 2048)`), 2048 centroids of which
32 are scored, E2B's vocabulary, and about 78 M parameters (170 MB in bf16). ASSUMED, not published here: 4 layers
(3 sliding, 1 full, as the demo's assistant) and an MLP of 2048, which with E2B's 8 query heads and its head dims
(256 sliding, 512 full) come to about 80 M parameters. Random bf16 weights (`e2b_width.random_weight`) and a random
token order, cached beside the target checkpoint.

Then `optimum-cli export qnn --model <e2b-full> --assistant <drafter> --soc SM8650 --quant 16a4w_block -v` with
default flags otherwise, in a 16 GB memory cgroup (benchmarks/e2b_full.run_export), stored in e2b_full.json under
the key `assistant@16GB` with the drafter's parameter count and its share of the `.pte`.

Run it alone: it needs most of the machine's memory for 15-25 minutes.

Usage: python benchmarks/assistant_full.py [--work DIR] [--memory-limit GB] [--build-only]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import e2b_full  # noqa: E402
import e2b_width  # noqa: E402

RECIPE = {"version": 1, "hidden": 256, "intermediate": 2048, "centroids": [2048, 32], "seed": 0}


def build(folder: Path) -> Path:
    """Write the drafter checkpoint to ``folder`` unless the same recipe is there already."""
    from safetensors.torch import save_file
    from transformers import Gemma4AssistantForCausalLM

    import tiny_gemma4_assistant
    from optimum_qnn.models.gemma4.assistant import buildable_assistant_config

    stamp = folder / "recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == RECIPE:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = tiny_gemma4_assistant.assistant_config(
        e2b_width.e2b_config(), hidden=RECIPE["hidden"], intermediate=RECIPE["intermediate"],
        centroids=tuple(RECIPE["centroids"]))
    buildable_assistant_config(config)
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(config)
    gen = torch.Generator().manual_seed(RECIPE["seed"])
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the token table
        if t.dtype in (torch.int32, torch.int64):  # the clustered embedding's token order: a permutation
            state[name] = torch.randperm(t.numel(), generator=gen).to(t.dtype).view(t.shape)
        else:
            state[name] = e2b_width.random_weight(tuple(t.shape), gen)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    stamp.write_text(json.dumps(RECIPE))
    return folder


def parameters(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/e2b-assistant-full"))
    parser.add_argument("--memory-limit", type=float, default=16.0, metavar="GB")
    parser.add_argument("--build-only", action="store_true", help="build (or find) the two checkpoints and stop")
    args = parser.parse_args()
    target = e2b_full.build(e2b_full.CACHE / "bench-models" / "e2b-full")
    drafter = build(e2b_full.CACHE / "bench-models" / "e2b-full-assistant")
    n = parameters(drafter)
    print(f"target: {target}\ndrafter: {drafter} ({n / 1e6:.1f} M parameters, assumed layers and MLP: see the docstring)")
    if args.build_only:
        return 0
    result = e2b_full.run_export(target, args.work / "out", "SM8650", "16a4w_block", ["--assistant", str(drafter)],
                                 args.memory_limit, allow_failure=True)
    result["label"] = (f"--assistant (a drafter of the published facts, {n / 1e6:.0f} M parameters, layers and MLP "
                       f"assumed) in a {args.memory_limit:g} GB memory cgroup")
    result["drafter_parameters"] = n
    e2b_full.store(e2b_full.rows_path("e2b"), f"assistant@{args.memory_limit:g}GB", result)
    print(json.dumps({k: v for k, v in result.items() if k in ("wall_s", "max_rss_gb", "pte_gb", "failed")}))
    return 0 if "failed" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
