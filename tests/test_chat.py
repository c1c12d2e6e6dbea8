"""Conversations on the host backend (HTP emulator): a turn prefills only its own tokens and gives the same greedy
tokens as a full prefill of the whole conversation; prefix reuse for callers that send the whole history; the rule
for a conversation that outgrows the context."""

from __future__ import annotations

import logging

import pytest
import torch

from optimum_qnn.errors import ContextOverflowError, InvalidInputError

# Five short user turns and 3-token replies. The equality test formats them with a compact template (one short line a
# turn) so that five turns fit the shared test exports' contexts (64 and 96 tokens): the conversation still crosses
# the demo's sliding window (16) and several prefill-chunk boundaries (16). The demo's own Gemma4-shaped template
# (about 35 tokens a turn, its turn markers being plain text there) is checked over two turns below.
TURNS = ["for", "if x:", "a list", "while", "hello"]
REPLY_TOKENS = 3
COMPACT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ ('Q:' if m['role'] == 'user' else 'A:') + m['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
)

EXPORTS = {
    "fp16-hybrid": lambda request: request.getfixturevalue("fp16_export").output,
    "fp16-kv": lambda request: request.getfixturevalue("demo_kv_export"),
    "16a8w-hybrid": lambda request: request.getfixturevalue("a16w8_export")("hybrid"),
    "16a8w-kv": lambda request: request.getfixturevalue("a16w8_export")("kv"),
}


class Collect:
    """A streamer that keeps the tokens it is given."""

    def __init__(self):
        self.tokens: list[int] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.tokens += value.reshape(-1).tolist()

    def end(self) -> None:
        self.ended = True


# 16a8w in kv mode in `make test-all` only (~300 s, most of it its own export, which no other test of `make test` reads):
# the conversation's session code is the same for every scheme and mode, and kv mode is checked at fp16 here, 16a8w's
# integer IO in hybrid mode.
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name == "16a8w-kv" else name
                                        for name in EXPORTS])
def chat_model(request):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    return request.param, QNNModelForCausalLM.from_pretrained(EXPORTS[request.param](request))


def _conversation(model, tokenizer, turns):
    """Send ``turns`` through one session; then check each turn against a full prefill of its whole prompt."""
    model.clear_cache()  # the model is shared with other test files: nothing they left in its caches is reused
    chat = model.chat(tokenizer=tokenizer, max_new_tokens=REPLY_TOKENS)
    prompts, replies, stats = [], [], []
    for text in turns:
        streamer = Collect()
        held = chat.input_ids
        chat.send(text, streamer=streamer)
        s = chat.stats
        prompt = chat.input_ids[: s.prompt_tokens]
        assert prompt[: len(held)] == held  # the turn appended to what the session held
        prompts.append(prompt)
        replies.append(streamer.tokens)
        stats.append((s.reused_tokens, s.prefilled_tokens, s.prompt_tokens))
    # Turn k >= 2 reuses every token the model has read (the previous prompt and all its reply but the last token,
    # which was picked and never fed) and prefills only the rest.
    for k in range(1, len(turns)):
        read = len(prompts[k - 1]) + len(replies[k - 1]) - 1
        assert stats[k][0] == read, (k, stats[k])
        assert stats[k][1] == stats[k][2] - read
    assert stats[0][0] == 0 and chat.stats.dropped_turns == 0
    # The reference: every turn's whole prompt through a fresh prefill (after the conversation, so the session's
    # caches were its own).
    for k, prompt in enumerate(prompts):
        out = model.generate(prompt, max_new_tokens=REPLY_TOKENS, eos_token_id=sorted(chat.stop_ids))
        assert model.stats.reused_tokens == 0
        assert out[0, len(prompt):].tolist() == replies[k], k
    assert chat.history[0] == {"role": "user", "content": turns[0]} and len(chat.history) == 2 * len(turns)
    return prompts


def test_five_turns_equal_full_prefill_each_turn(chat_model):
    which, model = chat_model
    tok = model.tokenizer()
    tok.chat_template = COMPACT_TEMPLATE
    prompts = _conversation(model, tok, TURNS)
    # The conversation crossed the sliding window and prefill chunks: turn 2 already starts past the first chunk.
    assert len(prompts[1]) > 16 and len(prompts[-1]) > 3 * 16, (which, [len(p) for p in prompts])


def test_two_turns_with_the_artifacts_own_template(fp16_model):
    """The artifact's template (Gemma4's turn layout): what closes a turn is appended as that template writes it."""
    prompts = _conversation(fp16_model, None, TURNS[:2])
    assert len(prompts[1]) > 2 * 16


@pytest.fixture(scope="module")
def hybrid(fp16_model):
    return fp16_model


def test_prefix_reuse_ending_inside_a_prefill_chunk(hybrid):
    model = hybrid
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(6, model.contract.vocab_size, (40,), generator=gen).tolist()
    model.generate(first, max_new_tokens=3, eos_token_id=[], reuse_cache=True)
    # 21 shared tokens: the first prefill chunk wrote slots 0-15, the second 16-31; the match ends inside it.
    second = first[:21] + torch.randint(6, model.contract.vocab_size, (12,), generator=gen).tolist()
    got = model.generate(second, max_new_tokens=6, eos_token_id=[], reuse_cache=True)[0].tolist()
    assert (model.stats.reused_tokens, model.stats.prefilled_tokens) == (21, 12)
    want = model.generate(second, max_new_tokens=6, eos_token_id=[])[0].tolist()
    assert model.stats.reused_tokens == 0 and got == want
    # The whole held prompt again: everything but its last token is reused (its logits are needed).
    again = model.generate(second, max_new_tokens=6, eos_token_id=[], reuse_cache=True)[0].tolist()
    assert model.stats.reused_tokens == len(second) - 1 and again == want
    # Nothing shared: nothing reused. A cleared cache: nothing reused either.
    model.generate([7] + second, max_new_tokens=2, eos_token_id=[], reuse_cache=True)
    assert model.stats.reused_tokens == 0
    model.clear_cache()
    model.generate([7] + second, max_new_tokens=2, eos_token_id=[], reuse_cache=True)
    assert model.stats.reused_tokens == 0


def test_cancel_stops_the_reply_and_keeps_the_session(hybrid):
    chat = hybrid.chat(max_new_tokens=12)
    streamer = Collect()
    chat.send(TURNS[0], streamer=streamer, cancel=lambda: len(streamer.tokens) >= 2)
    assert chat.stats.stopped_by == "cancelled" and len(streamer.tokens) == 2
    assert chat.history[-1]["role"] == "assistant"
    first_prompt = chat.stats.prompt_tokens
    chat.send(TURNS[1])
    assert chat.stats.reused_tokens == first_prompt + 2 - 1  # the cancelled reply's first token was read


@pytest.fixture(scope="module", params=["fp16-hybrid", "fp16-kv-ring"])
def overflow_model(request):
    """The shared fp16 hybrid export (context 96), and the ring-layout variant of tests/conftest.py `layouts_export`
    (context 128, kv mode, sliding layers keeping a ring of 7 slots): the dropping rule must hold in both layouts."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    if request.param == "fp16-hybrid":
        return request.getfixturevalue("fp16_model")
    model = QNNModelForCausalLM.from_pretrained(request.getfixturevalue("layouts_export"), context_len=128)
    assert model.manifest.contract.cache_layout == "ring"
    return model


def test_a_full_context_drops_the_oldest_turns_once(overflow_model, caplog):
    model = overflow_model
    model.clear_cache()  # the model is shared with other test files: nothing they left in its caches is reused
    chat = model.chat(system="Answer from the Python docs.", max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="optimum_qnn.runtime.chat"):
        dropped_at = None
        for i in range(12):
            chat.send(f"{TURNS[i % len(TURNS)]} {TURNS[(i + 2) % len(TURNS)]}")
            if chat.stats.dropped_turns:
                dropped_at = i
                break
    assert dropped_at is not None, "the conversation never filled the context"
    warnings = [r for r in caplog.records if "no longer fits" in r.getMessage()]
    assert len(warnings) == 1 and "kept the system prompt" in warnings[0].getMessage()
    history = chat.history
    assert history[0] == {"role": "system", "content": "Answer from the Python docs."}
    assert len(history) == 1 + 2 * (dropped_at + 1 - chat.stats.dropped_turns)
    assert history[1]["content"] == f"{TURNS[chat.stats.dropped_turns % len(TURNS)]} {TURNS[(chat.stats.dropped_turns + 2) % len(TURNS)]}"
    # What was kept was read again from the start of the template's rendering (the system prompt's tokens reused).
    tok = chat.tokenizer
    rendered = tok.apply_chat_template(history[:-1], add_generation_prompt=True, tokenize=False)
    assert chat.input_ids[: chat.stats.prompt_tokens] == tok(rendered, add_special_tokens=False)["input_ids"]
    assert chat.stats.prompt_tokens + min(8, model.contract.context_len // 4) <= model.contract.context_len


def test_a_turn_longer_than_the_context_is_refused_and_changes_nothing(hybrid):
    chat = hybrid.chat(max_new_tokens=2)
    chat.send(TURNS[0])
    before = (chat.history, chat.input_ids)
    with pytest.raises(ContextOverflowError, match="exported context"):
        chat.send(" ".join(TURNS * 40))
    assert (chat.history, chat.input_ids) == before
    with pytest.raises(InvalidInputError, match="unknown option"):
        chat.send("hello", max_tokens=3)
    with pytest.raises(InvalidInputError, match="non-empty string"):
        chat.send("  ")


def test_reset_keeps_the_system_prompt(hybrid):
    chat = hybrid.chat(system="Be brief.", max_new_tokens=2)
    chat.send(TURNS[0])
    chat.reset()
    assert chat.history == [{"role": "system", "content": "Be brief."}] and chat.input_ids == []
    chat.send(TURNS[1])
    assert chat.stats.reused_tokens > 0  # the system turn's tokens are still in the cache


class _Loop:
    """Stands in for the event loop and queue a job's text pieces are handed to (from the engine's thread)."""

    def __init__(self):
        self.pieces: list[str] = []

    def call_soon_threadsafe(self, fn, piece):
        fn(piece)

    def put_nowait(self, piece):
        self.pieces.append(piece)


def test_stop_strings_are_held_back_until_they_cannot_match():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from optimum_qnn.runtime.server.engine import Job, _JobStreamer

    words = ["<eos>", "<turn|>", "ab", "cd", "ef", "gh"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": ["<turn|>"]})

    from optimum_qnn.runtime.stops import conversation_stop_ids, text_stop_ids

    assert conversation_stop_ids([0], fast) == [0, 1] and text_stop_ids([0], fast, chat=False) == [0]
    assert fast.decode([2, 3, 4, 5]) == "ab cd ef gh"
    job = Job([0], {}, stop=["f g"])
    job.loop = job.pieces = _Loop()
    streamer = _JobStreamer(job, fast)
    for token in (2, 3, 4):
        streamer.put(torch.tensor([token]))
    # "ab cd ef": its last two characters could begin "f g", so only "ab cd " is out
    assert "".join(job.loop.pieces) == "ab cd " and not job.cancelled.is_set()
    streamer.put(torch.tensor([5]))
    assert job.finish_reason == "stop" and job.cancelled.is_set() and job.text == "ab cd e"
    streamer.end()
    assert "".join(job.loop.pieces) == "ab cd e"
