"""The demo model's trained assistant (examples/tiny_gemma4_assistant.py): it loads, fits its target, and drafts tokens
the target accepts on text held out from its training, without changing greedy output."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

K, NEW_TOKENS, PROMPTS = 3, 32, 4


@pytest.fixture(autouse=True)
def one_thread():
    """Greedy decoding of these tiny models on one torch thread: on a busy 2-core machine two threads spun for 67 s of
    CPU over what one thread does in 1.5 s (4 prompts, plain and K=3)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair(demo_model_dir, demo_assistant_dir):
    from transformers import Gemma4ForCausalLM

    from optimum_qnn.models.gemma4.loading import load_assistant

    target = Gemma4ForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return target, load_assistant(demo_assistant_dir)


def test_demo_assistant_loads_and_fits_the_demo_model(pair, demo_assistant_dir):
    from transformers import Gemma4AssistantForCausalLM

    from optimum_qnn.models.gemma4.assistant import check_assistant_ties

    target, assistant = pair
    check_assistant_ties(assistant.config, target.config)
    assert assistant.config.backbone_hidden_size == target.config.hidden_size
    assert assistant.config.get_text_config().hidden_size < target.config.hidden_size
    # transformers alone reads the folder too (its config.json carries the kv_sharing_modes override it needs)
    plain = Gemma4AssistantForCausalLM.from_pretrained(demo_assistant_dir, dtype=torch.float32)
    for name, tensor in assistant.state_dict().items():
        assert torch.equal(tensor, plain.state_dict()[name]), name


def test_demo_assistant_drafts_accepted_tokens_on_heldout_text(pair, demo_model_dir):
    import assistant_accept
    import tiny_gemma4_assistant

    target, assistant = pair
    prompts = assistant_accept.heldout_prompts(tiny_gemma4_assistant.heldout_ids(demo_model_dir), PROMPTS)
    total = assistant_accept.DraftCount()
    for prompt in prompts:
        expected, plain = assistant_accept.greedy(target, prompt, NEW_TOKENS)
        out, count = assistant_accept.greedy(target, prompt, NEW_TOKENS, assistant, K)
        assert torch.equal(out, expected)
        assert plain.calls == plain.tokens == NEW_TOKENS - 1  # plain decoding: one token per call
        assert count.tokens == NEW_TOKENS - 1 and count.calls < count.tokens and count.drafts <= K * count.calls
        total += count
    assert total.tokens_per_call > 1.5, total


def test_demo_assistant_is_rebuilt_when_the_demo_model_changes(demo_model_dir, demo_assistant_dir, tmp_path):
    import tiny_gemma4_assistant

    target, out = tmp_path / "target", tmp_path / "assistant"
    target.mkdir()
    shutil.copy(demo_model_dir / "build.json", target)
    shutil.copytree(demo_assistant_dir, out)
    assert tiny_gemma4_assistant.is_built(target, out)
    stamp = json.loads((target / "build.json").read_text())
    (target / "build.json").write_text(json.dumps({**stamp, "steps": stamp["steps"] + 1}))
    assert not tiny_gemma4_assistant.is_built(target, out)
    assert not tiny_gemma4_assistant.is_built(demo_model_dir, out, steps=tiny_gemma4_assistant.STEPS + 1)
