"""Build the built-in demo model: a small Gemma4 text model with every trait on, plus its own tokenizer.

Everything is local and deterministic: the corpus is the Python reference documentation that CPython ships
(`pydoc_data.topics`), the tokenizer is a byte-level BPE trained on it with `tokenizers`, and the model trains
on it for a short, fixed number of steps so that its greedy continuations are readable (it memorises phrases of
the Python docs). The folder it writes is a regular Hugging Face checkpoint (config.json, safetensors,
tokenizer.json), which the exporter then loads like any other.

Two sizes: `demo` (1.3 M parameters, a minute of training: the README's demo and the tests) and `bench` (23 M
parameters, trained by `make bench` on 2 cores (its training time is a row of benchmarks/RESULTS.md), for the 4-bit
weight measurements of benchmarks/QUANT_NOTES.md).

The demo's tokenizer also carries a chat template of Gemma4's shape (``<bos><|turn>user\n...<turn|>\n<|turn>model\n``),
so conversations and the server run on it. Its turn markers are plain text there (several tokens each, not trained
on), which keeps the demo's weights and every figure measured on it unchanged; a reply ends at ``<eos>``. The real
Gemma4 checkpoints ship their own template, with ``<|turn>`` / ``<turn|>`` as special tokens.

Usage: ``python examples/tiny_gemma4.py OUT_DIR [--size demo|bench] [--steps N]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0, 1, 2, 3: Gemma's pad/eos/bos convention
VOCAB = 512
BENCH_VOCAB = 2048
RECIPE_VERSION = 2  # bump when anything below changes, so cached builds are rebuilt (2: portable kernels)
# Training runs on this many threads whatever the machine or the calling process has set: the split of each
# kernel's sums depends on it, so the weights (and every figure measured on them) do. 2 is what they were measured with.
TRAIN_THREADS = 2
# The CPU kernels torch (ATen's AVX2 / AVX-512 builds), MKL (a path per vendor and ISA) and oneDNN pick depend on the
# machine, and each sums in its own order: with one seed and one thread count, an AMD EPYC without AVX-512 and an
# Intel Xeon with it trained different weights, so every figure and near tie the tests meet moved with the machine
# CI happened to run on. Training runs with the kernels every x86-64 CPU has, in a process started with them (they
# are read when torch loads): 30 steps gave one weights' hash with MKL held to SSE4.2 or not, and another under each
# of the four native combinations.
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
CHAT_VERSION = 1  # the demo's chat template (bump on change; the bench model has none)

# Gemma4's chat layout (the real checkpoints ship their own template in their tokenizer files): an optional system
# turn, then user and model turns, each closed by <turn|> and a newline; the model's turn is left open to generate.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ message['content'] + '<turn|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _gemma4(vocab: int, hidden: int, mlp: int, heads: int, head_dims: tuple[int, int], layer_types: list[str],
            window: int, ple: int) -> Gemma4TextConfig:
    """A Gemma4 text config with every trait on: sliding and full layers, 2 KV heads on sliding layers and 1 on full
    ones with k_eq_v, the last 2 layers reusing KV with a double-wide MLP, per-layer embeddings, partial RoPE (full
    layers' default), final logit softcap."""
    return Gemma4TextConfig(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=len(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=head_dims[0],
        global_head_dim=head_dims[1],
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=layer_types,
        sliding_window=window,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=ple,
        final_logit_softcapping=30.0,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def demo_config() -> Gemma4TextConfig:
    """4 sliding + 2 full layers, window 16, head_dim 32 / 64, hidden 128: 1.3 M parameters."""
    layer_types = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    return _gemma4(VOCAB, 128, 256, 4, (32, 64), layer_types, window=16, ple=16)


def bench_config() -> Gemma4TextConfig:
    """The same traits at 3x the width and 8 layers (6 sliding, 2 full; the last 2 reuse KV), window 64, a
    2048-token vocabulary: 23 M parameters."""
    layer_types = (["sliding_attention"] * 3 + ["full_attention"]) * 2
    return _gemma4(BENCH_VOCAB, 384, 1536, 6, (64, 128), layer_types, window=64, ple=32)


@dataclass(frozen=True)
class Size:
    """How one model size is built: its config, tokenizer vocabulary and training schedule."""

    config: Callable[[], Gemma4TextConfig]
    vocab: int
    steps: int
    lr: float
    seq: int
    chat: bool = False  # a chat template in the tokenizer files (nothing else changes)


SIZES = {
    "demo": Size(demo_config, VOCAB, steps=300, lr=3e-3, seq=96, chat=True),
    "bench": Size(bench_config, BENCH_VOCAB, steps=480, lr=2e-3, seq=128),
}


def train_tokenizer(text: str, vocab: int = VOCAB) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def train(
    model: Gemma4ForCausalLM, ids: torch.Tensor, steps: int, seq: int = 96, batch: int = 16, lr: float = 3e-3
) -> float:
    return fit(model, lambda x: model(input_ids=x, labels=x).loss, ids, steps, seq, batch, lr)


def fit(model: torch.nn.Module, loss_of: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, steps: int,
        seq: int, batch: int, lr: float, *, what: str = "train step", every: int = 100) -> float:
    """Train ``model``'s parameters on ``loss_of(batch of seq-token windows of ids)`` (AdamW, one-cycle schedule, a
    seeded window sampler); returns the last loss."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
        loss = loss_of(torch.stack([ids[s : s + seq] for s in starts]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % every == 0 or step == steps - 1:
            print(f"  {what} {step + 1}/{steps}  loss {loss.item():.3f}", flush=True)
    model.eval()
    return loss.item()


def build(out: Path, steps: int | None = None, size: str = "demo") -> Path:
    """Write the `size` checkpoint to ``out`` (skipped when an identical build is already there)."""
    out = Path(out)
    if is_built(out, steps, size):
        return out
    if not trains_here(Path(__file__), [str(out), "--size", size, *(["--steps", str(steps)] if steps else [])]):
        return out
    with reproducible():
        _build(out, size, steps)
    return out


def trains_here(script: Path, args: list[str]) -> bool:
    """Whether this process was started with `PORTABLE_KERNELS` (then the caller trains in it); otherwise runs
    ``script args`` in a child process that is, and returns False once it has built (its output passes through)."""
    if all(os.environ.get(k) == v for k, v in PORTABLE_KERNELS.items()):
        return True
    subprocess.run([sys.executable, str(script), *args], env={**os.environ, **PORTABLE_KERNELS}, check=True)
    return False


def is_built(out: Path, steps: int | None = None, size: str = "demo") -> bool:
    """Whether ``out`` holds this recipe's `size` build already."""
    stamp = Path(out) / "build.json"
    return stamp.is_file() and json.loads(stamp.read_text()) == _stamp(steps, size)


def _stamp(steps: int | None, size: str) -> dict:
    spec = SIZES[size]
    want = {"recipe": RECIPE_VERSION, "steps": spec.steps if steps is None else steps, "torch": torch.__version__,
            "threads": TRAIN_THREADS}
    if size != "demo":
        want["size"] = size
    if spec.chat:
        want["chat"] = CHAT_VERSION
    return want


@contextlib.contextmanager
def reproducible(train_threads: int = TRAIN_THREADS):
    """Seeded, deterministic kernels on ``train_threads`` threads; the caller's settings come back afterwards."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    rng = torch.random.get_rng_state()
    torch.set_num_threads(train_threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.random.set_rng_state(rng)


def _build(out: Path, size: str, steps: int | None) -> None:
    t0 = time.time()
    spec, want = SIZES[size], _stamp(steps, size)
    steps = want["steps"]
    text = corpus()
    tok = train_tokenizer(text, spec.vocab)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    cfg = spec.config()
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg)
    print(f"Training the {size} Gemma4 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params) on {ids.numel()} tokens")
    loss = train(model, ids, steps, seq=spec.seq, lr=spec.lr)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(out)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    if spec.chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    (out / "build.json").write_text(json.dumps(want))
    print(f"The {size} model written to {out} in {time.time() - t0:.0f} s (final loss {loss:.2f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=list(SIZES), default="demo")
    parser.add_argument("--steps", type=int, help="training steps (default: the size's)")
    args = parser.parse_args()
    build(args.out, args.steps, args.size)
