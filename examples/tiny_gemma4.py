"""Build the built-in demo model: a small Gemma4 text model with every trait on, plus its own tokenizer.

Everything is local and deterministic: the corpus is the Python reference documentation that CPython ships
(`pydoc_data.topics`), the tokenizer is a byte-level BPE trained on it with `tokenizers`, and the model trains
on it for a short, fixed number of steps so that its greedy continuations are readable (it memorises phrases of
the Python docs). The folder it writes is a regular Hugging Face checkpoint (config.json, safetensors,
tokenizer.json), which the exporter then loads like any other.

Usage: ``python examples/tiny_gemma4.py OUT_DIR [--steps N]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0, 1, 2, 3: Gemma's pad/eos/bos convention
VOCAB = 512
RECIPE_VERSION = 1  # bump when anything below changes, so cached builds are rebuilt


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def demo_config() -> Gemma4TextConfig:
    """Every Gemma4 trait: 4 sliding + 2 full layers, window 16, head_dim 16 / 32, 1 KV head on full layers with
    k_eq_v, the last 2 layers reusing KV, a double-wide MLP there, per-layer embeddings, partial RoPE, softcap."""
    return Gemma4TextConfig(
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        sliding_window=16,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=16,
        final_logit_softcapping=30.0,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def train_tokenizer(text: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def train(model: Gemma4ForCausalLM, ids: torch.Tensor, steps: int, seq: int = 96, batch: int = 16) -> float:
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  train step {step + 1}/{steps}  loss {loss.item():.3f}", flush=True)
    model.eval()
    return loss.item()


def build(out: Path, steps: int = 300) -> Path:
    """Write the demo checkpoint to ``out`` (skipped when an identical build is already there)."""
    out = Path(out)
    stamp = out / "build.json"
    want = {"recipe": RECIPE_VERSION, "steps": steps, "torch": torch.__version__}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return out
    t0 = time.time()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    text = corpus()
    tok = train_tokenizer(text)
    ids = torch.tensor(tok.encode(text).ids, dtype=torch.long)
    cfg = demo_config()
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg)
    print(f"Training the demo Gemma4 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params) on {ids.numel()} tokens")
    loss = train(model, ids, steps)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(out)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(out)
    stamp.write_text(json.dumps(want))
    print(f"Demo model written to {out} in {time.time() - t0:.0f} s (final loss {loss:.2f})")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    build(args.out, args.steps)
