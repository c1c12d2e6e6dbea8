"""Build the demo model's assistant: a small Gemma 4 MTP drafter distilled from the frozen demo Gemma4.

The assistant reads what Gemma 4's assistant reads (docs/assistant.md): the target's scaled embedding of the last
token, the target's last hidden state (after its final norm), one position, and the K/V of the target's last
cache-owning full and sliding layers. It is trained the way it drafts (transformers 5.23.0
``SinglePositionMultiTokenCandidateGenerator``): for every position ``t`` of a batch, step 1 reads the target's hidden
state at ``t`` and the embedding of token ``t + 1``, at position ``t + 1``, over the target's K/V of ``0 .. t``
(sliding layers: the last ``sliding_window`` of them); step ``k`` reads the drafter's own ``post_projection`` output of
step ``k - 1`` and token ``t + k``, at the same position over the same K/V. Each step's loss is the KL divergence from
the target's next-token distribution at ``t + k`` (teacher-forced: the target's hidden states, K/V and distributions
come from one forward of the frozen target over the text).

The text is the demo corpus (`tiny_gemma4.corpus`, tokenized by the demo's tokenizer); the assistant trains on its
first `TRAIN_FRACTION` of tokens and never sees the rest (`heldout_ids`), where benchmarks/assistant_accept.py
measures it. The demo target itself trained on the whole corpus.

Deterministic as the demo model is: seeded, deterministic kernels on `TRAIN_THREADS` thread(s), and a stamp in
build.json (this recipe, the steps, torch, the threads and the target's own stamp); `build` skips an identical build.

Usage: ``python examples/tiny_gemma4_assistant.py TARGET_DIR OUT_DIR [--steps N]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GenerationConfig,
)

import tiny_gemma4

RECIPE_VERSION = 1  # bump when anything below changes, so cached builds are rebuilt
TRAIN_THREADS = 1  # the weights depend on the thread count (the split of each kernel's sums): 1 is what was measured
TRAIN_FRACTION = 0.9  # of the demo corpus's tokens; the rest is held out for the acceptance measurement
STEPS, DRAFT_STEPS, BATCH, SEQ, LR = 300, 4, 16, 96, 3e-3
NUM_ASSISTANT_TOKENS = 3  # the K its generation_config.json proposes (transformers' assisted generation reads it)


def assistant_config(target: Gemma4TextConfig, hidden: int | None = None, intermediate: int | None = None,
                     centroids: tuple[int, int] | None = None) -> Gemma4AssistantConfig:
    """A 4-layer drafter (3 sliding, 1 full), by default of half the target's width and an MLP of twice it, tied to
    ``target`` as `check_assistant_ties` requires: its vocabulary, ``backbone_hidden_size`` = the target's width, and
    per attention kind the head_dim and KV heads of the target layer whose K/V it reads. ``centroids`` (clusters,
    clusters scored) switches on the clustered output embedding."""
    from optimum_qnn.contract import AttentionKind
    from optimum_qnn.models.gemma4.assistant import drafter_sources
    from optimum_qnn.models.gemma4.modules import gemma4_layer_specs

    sources = drafter_sources(gemma4_layer_specs(target))
    full, sliding = sources[AttentionKind.FULL], sources[AttentionKind.SLIDING]
    text = dict(
        vocab_size=target.vocab_size, hidden_size=hidden or target.hidden_size // 2,
        intermediate_size=intermediate or target.hidden_size * 2,
        num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_attention_heads=target.num_attention_heads, num_key_value_heads=sliding.kv_heads, head_dim=sliding.head_dim,
        global_head_dim=full.head_dim, num_global_key_value_heads=full.kv_heads, attention_k_eq_v=True,
        sliding_window=target.sliding_window, rope_parameters=target.rope_parameters,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        max_position_embeddings=target.max_position_embeddings, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    extra = {} if centroids is None else dict(use_ordered_embeddings=True, num_centroids=centroids[0],
                                              centroid_intermediate_top_k=centroids[1])
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.hidden_size, **extra)


def corpus_ids(target_dir: Path) -> torch.Tensor:
    """The demo corpus tokenized by the target's own tokenizer."""
    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    return torch.tensor(tok.encode(tiny_gemma4.corpus()).ids, dtype=torch.long)


def split_at(ids: torch.Tensor) -> int:
    return int(ids.numel() * TRAIN_FRACTION)


def heldout_ids(target_dir: Path) -> torch.Tensor:
    """The demo corpus's tokens the assistant never trained on (its last ``1 - TRAIN_FRACTION``)."""
    ids = corpus_ids(target_dir)
    return ids[split_at(ids):]


def draft_masks(queries: int, columns: int, window: int) -> dict[str, torch.Tensor]:
    """Additive masks of the drafter's queries ``t = 0 .. queries - 1`` over the target's K/V columns: query ``t``
    drafts at position ``t + 1``, so it sees columns ``0 .. t`` (full) or ``t + 1 - window .. t`` (sliding)::

        full, window 2        sliding, window 2
        t=0  x . . .          x . . .
        t=1  x x . .          x x . .
        t=2  x x x .          . x x .
    """
    t = torch.arange(queries)[:, None]
    c = torch.arange(columns)[None, :]
    blocked = torch.finfo(torch.float32).min
    full = torch.where(c <= t, 0.0, blocked)
    sliding = torch.where((c <= t) & (c > t - window), 0.0, blocked)
    return {"full_attention": full[None, None], "sliding_attention": sliding[None, None]}


def draft_step(assistant: Gemma4AssistantForCausalLM, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               masks: dict[str, torch.Tensor], shared_kv: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafting step for many queries at once: what `Gemma4AssistantForCausalLM.forward` computes, with the masks
    given (a query per position, each with its own K/V columns) instead of its one-query bidirectional masks.
    Returns (logits, post_projection output)."""
    # output_hidden_states: with more than one query and no per-layer inputs, transformers 5.23.0's
    # Gemma4TextModel._maybe_slice_kv_shared_inputs indexes per_layer_inputs=None (TypeError); recording hidden
    # states is the one documented way around that slicing.
    h = assistant.model(
        inputs_embeds=assistant.pre_projection(torch.cat([embeds, hidden], dim=-1)), attention_mask=masks,
        position_ids=positions, shared_kv_states=shared_kv, use_cache=False, output_hidden_states=True,
    ).last_hidden_state
    return assistant.lm_head(h), assistant.post_projection(h)


def distill_loss(target: Gemma4ForCausalLM, assistant: Gemma4AssistantForCausalLM, x: torch.Tensor,
                 steps: int = DRAFT_STEPS) -> torch.Tensor:
    """Mean over the drafting steps of KL(target || drafter) on a batch ``x`` ``[B, T]`` (see the module docstring)."""
    with torch.no_grad():
        out = target(input_ids=x, output_hidden_states=True, return_shared_kv_states=True)
        teacher = F.log_softmax(out.logits.float(), dim=-1)
        shared_kv = {kind: (k.detach(), v.detach()) for kind, (k, v) in out.shared_kv_states.items()}
        embeds = target.get_input_embeddings()(x)
    queries = x.shape[1] - steps  # every query has all its steps' tokens and targets inside the batch
    masks = draft_masks(queries, x.shape[1], target.config.sliding_window)
    positions = torch.arange(1, queries + 1)[None].expand(x.shape[0], -1)
    hidden = out.hidden_states[-1][:, :queries]
    loss = torch.zeros(())
    for k in range(1, steps + 1):
        logits, hidden = draft_step(assistant, embeds[:, k : k + queries], hidden, positions, masks, shared_kv)
        logq = F.log_softmax(logits, dim=-1)
        loss = loss + F.kl_div(logq, teacher[:, k : k + queries], log_target=True, reduction="none").sum(-1).mean()
    return loss / steps


def train(target: Gemma4ForCausalLM, assistant: Gemma4AssistantForCausalLM, ids: torch.Tensor, steps: int) -> float:
    """Distill ``target`` into ``assistant`` (`distill_loss`) on windows of ``ids``; returns the last loss."""
    return tiny_gemma4.fit(assistant, lambda x: distill_loss(target, assistant, x), ids, steps, SEQ, BATCH, LR,
                           what="distill step (KL)", every=50)


def build(target_dir: Path, out: Path, steps: int | None = None) -> Path:
    """Write the demo target's assistant to ``out`` (skipped when an identical build is already there)."""
    out = Path(out)
    if is_built(target_dir, out, steps):
        return out
    if not tiny_gemma4.trains_here(Path(__file__), [str(target_dir), str(out), *(["--steps", str(steps)] if steps else [])]):
        return out
    with tiny_gemma4.reproducible(TRAIN_THREADS):
        _build(Path(target_dir), out, steps)
    return out


def is_built(target_dir: Path, out: Path, steps: int | None = None) -> bool:
    """Whether ``out`` holds this recipe's assistant of the build in ``target_dir``."""
    stamp = Path(out) / "build.json"
    return stamp.is_file() and json.loads(stamp.read_text()) == _stamp(target_dir, steps)


def _stamp(target_dir: Path, steps: int | None) -> dict:
    target_stamp = Path(target_dir) / "build.json"
    target = json.loads(target_stamp.read_text()) if target_stamp.is_file() else None
    return {"recipe": RECIPE_VERSION, "steps": STEPS if steps is None else steps, "torch": torch.__version__,
            "threads": TRAIN_THREADS, "target": target}


def _build(target_dir: Path, out: Path, steps: int | None) -> None:
    from optimum_qnn.models.gemma4.assistant import buildable_assistant_config, check_assistant_ties

    t0 = time.time()
    want = _stamp(target_dir, steps)
    target = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    target.requires_grad_(False)
    config = buildable_assistant_config(assistant_config(target.config))
    config.get_text_config()._attn_implementation = "eager"
    check_assistant_ties(config, target.config)
    assistant = Gemma4AssistantForCausalLM(config)
    ids = corpus_ids(target_dir)
    train_ids = ids[: split_at(ids)]
    n_params = sum(p.numel() for p in assistant.parameters()) / 1e6
    print(f"Distilling a {n_params:.2f} M-parameter assistant from {target_dir} on {train_ids.numel()} of the corpus's "
          f"{ids.numel()} tokens ({want['steps']} steps, {DRAFT_STEPS} drafting steps each)")
    loss = train(target, assistant, train_ids, want["steps"])
    out.mkdir(parents=True, exist_ok=True)
    assistant.save_pretrained(out)
    GenerationConfig(num_assistant_tokens=NUM_ASSISTANT_TOKENS, num_assistant_tokens_schedule="constant",
                     bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(out)
    (out / "build.json").write_text(json.dumps(want))
    print(f"The demo assistant written to {out} in {time.time() - t0:.0f} s (final KL {loss:.3f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="the demo model's folder (examples/tiny_gemma4.py builds it)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, help=f"training steps (default: {STEPS})")
    args = parser.parse_args()
    build(args.target, args.out, args.steps)
