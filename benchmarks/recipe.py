"""What benchmarks/run.py measures with: its schemes, shapes, depths, stages, model folders and held-out text.

A leaf: every benchmark script and results.py read these settings from here, so none of them imports run.py (which
measures and then renders RESULTS.md through results.py).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent

# 16a4w_e2b is a recipe (optimum_qnn.config.RECIPES): 16a4w_block plus output-MSE ranges and a 25% 8-bit plan.
SCHEMES = ["fp16", "16a16w", "16a8w", "16a4w", "16a4w_block", "16a4w_e2b", "8a8w"]
CONTEXT, PREFILL = 128, 16
EVAL_TOKENS = 1024
EMBEDDING_BITS = {"fp16": 0}  # CPU-side tables: float for fp16, 8-bit per row otherwise
# Gemma-4-E2B widths at reduced depth: (layers, of which KV-reusing). Depth 7 has sliding and full layers of both kinds.
DEPTHS = {2: 0, 7: 2}
E2B_SCHEME, E2B_CONTEXT, E2B_PREFILL = "16a4w", 1024, 128
# One shard per decoder layer (`--shards depth`): each HTP context is compiled on its own, so the compiler's peak
# is one layer's, at every depth, and the line through the depths stays a line.
E2B_LAYERS_PER_SHARD = 1
# The larger benchmark model (examples/tiny_gemma4.py --size bench) at the schemes a phone build chooses between.
BENCH_SCHEMES = ["16a8w", "16a4w_block", "16a4w_e2b"]
SECTIONS = ["schemes", "bench", "e2b", "peer"]
ROWS_FILE = HERE / "rows.json"
# "edge" is the SoC-independent half of the lowering, done once per export (866bf35); rows measured before it have
# the whole lowering under "lower".
STAGES = ["load", "swap", "export", "calibrate", "quantize", "edge", "lower", "write"]
# The models are cached where the package caches (`$OPTIMUM_QNN_CACHE`), the demo model where the tests keep it
# (`$OPTIMUM_QNN_TEST_CACHE`), so a checkout whose examples/tiny_gemma4.py differs never rebuilds another's models.
CACHE = Path(os.environ.get("OPTIMUM_QNN_CACHE", Path.home() / ".cache" / "optimum-qnn")).expanduser()
DEMO_DIR = Path(os.environ.get("OPTIMUM_QNN_TEST_CACHE", CACHE / "test-models")).expanduser() / "demo-gemma4"
MODEL_DIRS = {"demo": DEMO_DIR, "bench": CACHE / "bench-models" / "bench-gemma4"}
GREEDY_PROMPTS, GREEDY_PROMPT_TOKENS = 8, 24
# Held-out text for perplexity: docstrings of standard-library modules. The demo model trains on CPython's
# `pydoc_data.topics` (the language reference), which does not contain them.
HELD_OUT_MODULES = ["argparse", "collections", "csv", "functools", "itertools", "json", "logging", "pathlib", "subprocess", "textwrap"]



def held_out_text() -> str:
    import importlib

    return "\n\n".join(inspect.getdoc(importlib.import_module(name)) or "" for name in HELD_OUT_MODULES)



def held_out_prompts(tokenizer, count: int = GREEDY_PROMPTS, length: int = GREEDY_PROMPT_TOKENS) -> list[list[int]]:
    """`count` prompts of `length` tokens (BOS first), each the start of a different held-out module's docstring."""
    import importlib

    prompts = []
    for name in HELD_OUT_MODULES[:count]:
        ids = tokenizer(inspect.getdoc(importlib.import_module(name)) or "", add_special_tokens=False)["input_ids"]
        prompts.append([tokenizer.bos_token_id] + ids[: length - 1])
    return prompts

