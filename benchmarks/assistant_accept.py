"""Tokens per target call of the demo model's trained assistant: greedy drafting of K tokens, eager fp32, no export.

The demo Gemma4 (examples/tiny_gemma4.py) and its assistant distilled from it (examples/tiny_gemma4_assistant.py),
both fp32 and eager, two ways: transformers' own assisted generation (`generate(..., assistant_model=...)`, which runs
Gemma 4's `SinglePositionMultiTokenCandidateGenerator`), and a plain loop whose drafter reads the target's K/V of
accepted positions only, as the static drafter's masks do (`greedy_accepted_only`; transformers' drafter also reads
the K/V columns of rejected drafts after a rejection). The text is held out from the assistant's training: prompts
are cut from the demo corpus's last tokens (`tiny_gemma4_assistant.heldout_ids`), each continued greedily; every
assisted output is checked token for token against plain greedy decoding of the same prompt.

What is counted, per prompt: the target's calls after its prefill (each verifies the drafts of one round and yields
the accepted drafts plus its own token), the tokens they yield (every generated token but the prefill's first), and
the drafter's steps (one per drafted token). Tokens per target call = tokens / calls (plain decoding: 1.0);
acceptance rate = accepted drafts / drafted tokens. Rows go to benchmarks/assistant_accept.json; prints a table.

Usage: ``python benchmarks/assistant_accept.py [--prompts 24] [--new-tokens 64]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

PROMPT_TOKENS, NEW_TOKENS, PROMPTS, KS = 32, 64, 24, (1, 2, 3, 4)


@dataclass
class DraftCount:
    """What assisted greedy decoding cost: target calls after the prefill, the tokens they yielded, drafted tokens."""

    calls: int = 0
    tokens: int = 0
    drafts: int = 0

    def __iadd__(self, other: "DraftCount") -> "DraftCount":
        self.calls += other.calls
        self.tokens += other.tokens
        self.drafts += other.drafts
        return self

    @property
    def tokens_per_call(self) -> float:
        return self.tokens / self.calls

    @property
    def acceptance(self) -> float:
        return (self.tokens - self.calls) / self.drafts  # each call yields its accepted drafts plus one of its own


def heldout_prompts(ids, count: int = PROMPTS, length: int = PROMPT_TOKENS) -> list:
    """``count`` prompts of ``length`` tokens, evenly spaced over the held-out tokens ``ids``."""
    stride = (ids.numel() - length) // count
    return [ids[i * stride : i * stride + length][None] for i in range(count)]


def greedy(target, prompt, new_tokens: int, assistant=None, k: int = 0):
    """Greedy continuation of ``prompt`` (plain, or drafted ``k`` tokens at a time by ``assistant``) and its count."""
    import torch

    count = DraftCount()

    def on_target(*_):
        count.calls += 1

    def on_assistant(*_):
        count.drafts += 1

    hooks = [target.register_forward_hook(on_target)]
    kwargs = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        kwargs["assistant_model"] = assistant
        hooks.append(assistant.register_forward_hook(on_assistant))
    try:
        with torch.no_grad():
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                  do_sample=False, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    count.calls -= 1  # the prefill, which yields the first token in either method
    count.tokens = out.shape[1] - prompt.shape[1] - 1
    return out, count


def greedy_accepted_only(target, prompt, new_tokens: int, assistant, k: int):
    """Assisted greedy decoding where the drafter reads the target's K/V of accepted positions only (the static
    drafter's masks, docs/assistant.md): every target call runs over the whole sequence (no cache), so no column of a
    rejected draft is left to read. Returns what `greedy` does."""
    import torch

    window = assistant.config.get_text_config().sliding_window
    embed = target.get_input_embeddings()
    count, seq = DraftCount(), prompt
    with torch.no_grad():
        out = target(input_ids=seq, output_hidden_states=True, return_shared_kv_states=True)  # the prefill
        seq = torch.cat([seq, out.logits[:, -1:].argmax(-1)], dim=1)
        hidden = out.hidden_states[-1][:, -1:]
        while seq.shape[1] - prompt.shape[1] < new_tokens:
            p = seq.shape[1] - 1  # the last token's position: the drafter reads the target's K/V of [0, p)
            kv = {kind: tuple(t[:, :, max(0, p - window) if kind == "sliding_attention" else 0 : p] for t in pair)
                  for kind, pair in out.shared_kv_states.items()}
            token, drafts = seq[:, -1:], []
            for _ in range(min(k, new_tokens - (seq.shape[1] - prompt.shape[1]) - 1)):
                step = assistant(inputs_embeds=torch.cat([embed(token), hidden], dim=-1),
                                 position_ids=torch.tensor([[p]]), shared_kv_states=kv)
                token, hidden = step.logits.argmax(-1), step.last_hidden_state
                drafts.append(token)
            candidate = torch.cat([seq, *drafts], dim=1)
            out = target(input_ids=candidate, output_hidden_states=True, return_shared_kv_states=True)
            chosen = out.logits[0, p:].argmax(-1)  # the target's token after each of seq[p], drafts[0], ...
            accepted = 0
            while accepted < len(drafts) and int(drafts[accepted]) == int(chosen[accepted]):
                accepted += 1
            seq = torch.cat([candidate[:, : p + 1 + accepted], chosen[None, accepted : accepted + 1]], dim=1)
            hidden = out.hidden_states[-1][:, p + accepted : p + accepted + 1]
            count.calls, count.drafts = count.calls + 1, count.drafts + len(drafts)
    count.tokens = seq.shape[1] - prompt.shape[1] - 1
    return seq, count


def load_pair():
    """The demo model and its assistant (each built first when missing), fp32, eager."""
    import torch
    import tiny_gemma4
    import tiny_gemma4_assistant
    from transformers import Gemma4ForCausalLM

    import recipe  # the benchmarks' model cache: the demo where the tests keep it

    from optimum_qnn.models.gemma4.loading import load_assistant

    target_dir = tiny_gemma4.build(recipe.DEMO_DIR)
    assistant_dir = tiny_gemma4_assistant.build(target_dir, recipe.DEMO_DIR.parent / "demo-gemma4-assistant")
    target = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return target, load_assistant(assistant_dir), target_dir


# How the drafter reads the target: transformers' own generation (after a rejection its drafter also sees the rejected
# drafts' K/V columns, docs/assistant.md), and the static drafter's way (accepted positions only).
METHODS = {"transformers": greedy, "accepted_only": greedy_accepted_only}


def measure(target, assistant, prompts, new_tokens: int) -> dict[str, dict[int, DraftCount]]:
    """Each method's counts per K over ``prompts``; raises SystemExit when an output differs from plain greedy."""
    import torch

    plain = [greedy(target, p, new_tokens)[0] for p in prompts]
    counts = {name: {k: DraftCount() for k in KS} for name in METHODS}
    for name, method in METHODS.items():
        for k in KS:
            for i, (prompt, expected) in enumerate(zip(prompts, plain)):
                out, count = method(target, prompt, new_tokens, assistant, k)
                if not torch.equal(out, expected):
                    raise SystemExit(f"{name}, K={k}, prompt {i}: assisted greedy output differs from plain greedy")
                counts[name][k] += count
            print(f"{name}, K={k}: {len(prompts)} prompts, assisted output identical to plain greedy", flush=True)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args()

    from optimum_qnn.console import configure_logging, third_party_quiet

    configure_logging(False)
    with third_party_quiet(False, keep_stdout=True):
        import torch
        import tiny_gemma4_assistant

        torch.set_num_threads(1)
        target, assistant, target_dir = load_pair()
        prompts = heldout_prompts(tiny_gemma4_assistant.heldout_ids(target_dir), args.prompts)
        t0 = time.time()
        counts = measure(target, assistant, prompts, args.new_tokens)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    # keyed by K, so that a page quotes a figure by its row key (`assistant_accept:transformers/3/tokens_per_target_call`)
    rows = {name: {str(k): {"k": k, "tokens_per_target_call": round(c.tokens_per_call, 3),
                            "acceptance_rate": round(c.acceptance, 3),
                            "target_calls_per_100_tokens": round(100 / c.tokens_per_call, 1),
                            "target_calls": c.calls, "tokens": c.tokens, "drafted": c.drafts} for k, c in by_k.items()}
            for name, by_k in counts.items()}
    result = {
        "commit": commit, "date": time.strftime("%Y-%m-%d"),
        "model": "demo (examples/tiny_gemma4.py) + its assistant (examples/tiny_gemma4_assistant.py), fp32 eager",
        "decoding": "greedy; every output identical to plain greedy. transformers: generate(assistant_model=...); "
                    "accepted_only: the drafter reads the target's K/V of accepted positions only",
        "text": f"{args.prompts} prompts of {PROMPT_TOKENS} tokens from the demo corpus's last "
                f"{1 - tiny_gemma4_assistant.TRAIN_FRACTION:.0%} (held out from the assistant's training)",
        "new_tokens": args.new_tokens, "seconds": round(time.time() - t0, 1), **rows,
    }
    (HERE / "assistant_accept.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n| drafter reads | K | tokens per target call | acceptance rate | target calls per 100 tokens |")
    print("|---|---|---|---|---|")
    for name, by_k in rows.items():
        for row in by_k.values():
            print(f"| {name} | {row['k']} | {row['tokens_per_target_call']:.2f} | {row['acceptance_rate']:.2f} | "
                  f"{row['target_calls_per_100_tokens']:.1f} |")
    print(f"\nstored in {HERE / 'assistant_accept.json'} (commit {commit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
