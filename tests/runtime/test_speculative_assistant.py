"""Speculative decoding with Gemma 4's assistant (`runtime.assistant`, issue 52): the acceptance rule alone (numpy),
then a tiny target built for an assistant (hidden output, a decode call of K + 1 tokens) beside a tiny StaticDrafter
as eager static graphs through the host backend's generation loop, against plain decoding of the same graphs; and
the refusal of a variant without a drafter, from its manifest, before its program is loaded."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from optimum_qnn.contract import CacheLayout
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.runtime.assistant import accept_drafts
from optimum_qnn.runtime.generation import Sampling
from tests.conftest import run_main

K = 3  # drafts per round: the target's decode call takes K + 1 tokens
CTX, PREFILL = 96, 8  # the tiny target's window is 8: prompts of 5, 13 and 21 take 1, 2 and 3 prefill calls
PROMPT_LENS = (5, 13, 21)
NEW = 40


# --- the acceptance rule, numpy only ------------------------------------------------------------------------------

VOCAB = 5


def _dist(context: tuple[int, ...], salt: int) -> np.ndarray:
    """A fixed distribution over VOCAB tokens for each context (the fake model's next-token probabilities)."""
    rng = np.random.default_rng(abs(hash((context, salt))) % (1 << 32))
    p = rng.random(VOCAB) ** 2 + 0.02
    return p / p.sum()


def _logits(p: np.ndarray) -> np.ndarray:
    return np.log(p).astype(np.float32)


def _speculative_pair(context: tuple[int, ...], sampling: Sampling, drafter_salt: int) -> list[int]:
    """One round of the rule with fake target and drafter of known distributions (target: salt 0)."""
    drafts, probs, ctx = [], [], context
    for _ in range(2):
        q = sampling.probabilities(_logits(_dist(ctx, drafter_salt)))
        probs.append(q)
        drafts.append(sampling.draw(q))
        ctx = ctx + (drafts[-1],)
    rows = np.stack([_logits(_dist(context + tuple(drafts[:i]), 0)) for i in range(3)])
    return accept_drafts(drafts, probs, rows, sampling)


def _first_two(sampling: Sampling, drafter_salt: int) -> tuple[int, int]:
    """The first two tokens of a generation by rounds of the rule (a second round when the first gave one)."""
    out = _speculative_pair((), sampling, drafter_salt)
    if len(out) < 2:
        out += _speculative_pair(tuple(out), sampling, drafter_salt)
    return out[0], out[1]


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=0.7, top_k=3)], ids=["plain", "t0.7-top3"])
def test_speculative_sampling_draws_from_the_targets_distribution(filters):
    """4000 draws of the first two tokens (25 cells) through the rule with a drafter of other distributions: the
    counts fit the target's own filtered distribution p(t1) p(t2 | t1) (chi-square below the 0.999 quantile of its
    degrees of freedom, fixed seed), and do not fit the drafter's (the test can fail)."""
    draws = 4000
    sampling = Sampling(True, generator=np.random.default_rng(52), **filters)
    counts = np.zeros((VOCAB, VOCAB))
    for _ in range(draws):
        counts[_first_two(sampling, drafter_salt=1)] += 1

    def joint(salt: int) -> np.ndarray:
        p1 = sampling.probabilities(_logits(_dist((), salt)))
        return np.stack([p1[a] * sampling.probabilities(_logits(_dist((a,), salt))) for a in range(VOCAB)])

    target, drafter = joint(0) * draws, joint(1) * draws
    cells = int((target > 0).sum())
    critical = {25: 52.62, 9: 27.88}[cells]  # chi-square 0.999 quantile at cells - 1 degrees of freedom
    assert _chi_square(counts, target) < critical
    assert _chi_square(counts, drafter) > 10 * critical
    assert counts[target == 0].sum() == 0  # top-k: never a filtered-out token


def test_the_target_as_its_own_drafter_has_every_draft_accepted():
    """A stand-in "perfect drafter" (q = p, the target's own distributions): min(1, p/q) = 1, so every round gives
    K + 1 tokens, the drafts then the target's bonus token."""
    sampling = Sampling(True, generator=np.random.default_rng(0))
    for trial in range(200):
        context, drafts, probs = (trial % VOCAB,), [], []
        for _ in range(K):
            probs.append(sampling.probabilities(_logits(_dist(context + tuple(drafts), 0))))
            drafts.append(sampling.draw(probs[-1]))
        rows = np.stack([_logits(_dist(context + tuple(drafts[:i]), 0)) for i in range(K + 1)])
        out = accept_drafts(drafts, probs, rows, sampling)
        assert len(out) == K + 1 and out[:K] == drafts


def test_greedy_rule_keeps_the_matching_prefix_and_the_targets_next_token():
    rows = np.eye(6, dtype=np.float32)[[4, 2, 5, 1]]  # the target's argmaxes: 4, 2, 5, 1
    greedy = Sampling()
    assert accept_drafts([4, 2, 5], [], rows, greedy) == [4, 2, 5, 1]  # all accepted, plus the bonus token
    assert accept_drafts([4, 3, 5], [], rows, greedy) == [4, 2]  # the first mismatch gives the target's token
    assert accept_drafts([0, 2, 5], [], rows, greedy) == [4]
    assert accept_drafts([], [], rows[:1], greedy) == [4]


# --- eager static graphs through the host backend's loop ----------------------------------------------------------


def _record(method: str, window: int) -> SimpleNamespace:
    """The manifest's ``contract.assistant`` as the runtime reads it (`runtime.assistant.assistant_of`: these four
    fields; the export may record more)."""
    return SimpleNamespace(draft_len=K, method=method, verify_ar=K + 1, sliding_window=window)


@functools.lru_cache(maxsize=None)
def _tiny_pair(layout: str):
    """A tiny target with the hidden output and a decode call of K + 1 tokens, its tiny drafter as
    ``draft_forward`` in the same contract: (contract, methods, record, drafter)."""
    from optimum_qnn import StaticCausalLM
    from optimum_qnn.models.gemma4.assistant import StaticDrafter
    from optimum_qnn.session import torch_method
    from tests.gemma4_assistant_tiny import tiny_assistant, tiny_assistant_config
    from tests.gemma4_tiny import tiny_config, tiny_model

    config = tiny_config()
    target = StaticCausalLM.from_hf(tiny_model(config, seed=1), max_context_len=CTX, ar_len=PREFILL,
                                    cache_layout=CacheLayout(layout), hidden_output=True, decode_ar_len=K + 1)
    drafter = StaticDrafter.from_hf(tiny_assistant(tiny_assistant_config(config), seed=2), target)
    contract = dataclasses.replace(target.contract, methods=target.contract.methods + (drafter.method,))
    methods = {m.name: torch_method(target.module) for m in target.contract.methods}
    methods[drafter.method.name] = torch_method(drafter.module)
    return contract, methods, _record(drafter.method.name, drafter.window), drafter


def _backend(layout: str, draft=None):
    """The host backends' generation loop (`InProcessBackend`) over the tiny pair; ``draft`` replaces the drafter."""
    from optimum_qnn.runtime.backends.host import InProcessBackend

    contract, methods, record, _ = _tiny_pair(layout)
    if draft is not None:
        methods = {**methods, record.method: draft}
    manifest = SimpleNamespace(runner_contract=lambda: contract, tokenizer=SimpleNamespace(eos_ids=[1]),
                               contract=SimpleNamespace(lookahead=None, assistant=record))
    return InProcessBackend(manifest, methods, SimpleNamespace(total=0.0))


def _prompt(n: int) -> np.ndarray:
    return np.concatenate([[2], np.random.default_rng(n).integers(3, 256, n - 1)]).astype(np.int64)


def _generate(backend, prompt, n=NEW, sampling=Sampling(), eos=(), speculative=None) -> list[int]:
    return backend.generate(prompt, n, sampling, list(eos), None, speculative=speculative)


def _same_caches(a, b, atol: float = 1e-5) -> float:
    """Both sessions hold the same K/V in the same slots (the first ``n_past`` of a full-length cache, every slot of
    a ring); returns the largest difference."""
    assert a.n_past == b.n_past
    n, worst = min(a.n_past, CTX - 1), 0.0
    for x, y in zip(a.k_bufs + a.v_bufs, b.k_bufs + b.v_bufs):
        axis = -1 if x.shape[-1] == CTX - 1 else -2 if x.shape[-2] == CTX - 1 else None
        if axis is not None:
            x, y = np.take(x, range(n), axis=axis), np.take(y, range(n), axis=axis)
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=atol)
        worst = max(worst, float(np.abs(x - y).max()))
    return worst


@pytest.mark.parametrize("layout", ["full", "ring"])
def test_greedy_speculative_output_is_plain_greedy_output(layout):
    """Three prompts (1-3 prefill calls) x 40 new tokens, crossing the window of 8: the StaticDrafter's rounds give
    plain greedy's tokens of the same graphs, and the caches they keep equal plain decoding's; the stats count
    K drafter calls per target call."""
    plain, spec = _backend(layout), _backend(layout)
    for n in PROMPT_LENS:
        prompt = _prompt(n)
        want = _generate(plain, prompt)
        got = _generate(spec, prompt, speculative="assistant")
        s = spec.stats
        print(f"{layout} prompt {n}: {s.target_calls} target calls, {s.drafter_calls} drafter calls, "
              f"{s.accepted_tokens}/{s.drafted_tokens} drafts accepted")
        assert got == want
        assert s.speculative == "assistant" and s.decode_tokens == NEW - 1
        assert s.decode_tokens == s.target_calls + s.accepted_tokens
        assert s.drafter_calls == s.drafted_tokens <= K * s.target_calls
        assert plain.stats.target_calls == NEW - 1 and plain.stats.drafter_calls == 0
        _same_caches(plain.session, spec.session)


@pytest.mark.parametrize("layout", ["full", "ring"])
def test_the_host_opens_the_static_drafters_masks(layout):
    """The masks the host builds are `StaticDrafter.masks` (what tests/models/gemma4/test_assistant.py checks
    against transformers), cut to the draft method's cache columns: the verify call of K + 1 tokens leaves C - K - 1
    full-length slots, and the columns cut off are closed."""
    from optimum_qnn.runtime.assistant import AssistantDecoder, assistant_of
    from optimum_qnn.session import KVSession

    contract, methods, record, drafter = _tiny_pair(layout)
    session = KVSession(contract, methods)
    session.feed(_prompt(5))
    assistant = assistant_of(SimpleNamespace(contract=SimpleNamespace(assistant=record)))
    decoder = AssistantDecoder(session, assistant, methods[record.method], Sampling())
    assert [m.shape[-1] for m in decoder.masks(1)] == [CTX - K - 1, CTX - K - 1 if layout == "full" else 8]
    for p in (1, 7, 8, 9, 40, CTX - K - 1):
        for got, want in zip(decoder.masks(p), drafter.masks(p)):
            want = want.numpy()
            assert (got == want[..., : got.shape[-1]]).all() and (want[..., got.shape[-1] :] < 0).all()


def _oracle(sequence: list[int], seen: list, wrong_every: int = 4):
    """A stand-in drafter that knows plain greedy's ``sequence``: at position p, draft j of a round proposes the
    token at p + j + 1, except a wrong one where ``(p + j) % wrong_every == 1``: rounds accept 0..K drafts. Its
    ``hidden_out`` is ``10 p + j`` everywhere; ``seen`` gets (p, j, token, hidden) of every call."""
    state = {"position": -1, "j": 0}

    def draft(inputs):
        p = int(inputs[4][0, 0])
        state["j"] = state["j"] + 1 if p == state["position"] else 0
        state["position"] = p
        j = state["j"]
        seen.append((p, j, int(inputs[0][0, 0]), np.array(inputs[1]).reshape(-1)))
        token = sequence[p + j + 1] if p + j + 1 < len(sequence) else 0
        if (p + j) % wrong_every == 1:
            token = (token + 1) % 256
        logits = np.zeros((1, 1, 256), dtype=np.float32)
        logits[0, 0, token] = 1.0
        return logits, np.full(inputs[1].shape, 10.0 * p + j, dtype=np.float32)

    return draft


def _hidden_by_position(layout: str, sequence: list[int]) -> np.ndarray:
    """The target's final hidden state at each position of ``sequence``, one decode call per token."""
    from optimum_qnn.session import KVSession

    contract, methods, _, _ = _tiny_pair(layout)
    session = KVSession(contract, methods)
    rows = []
    for token in sequence:
        session.feed(np.array([token]))
        rows.append(session.hidden[-1])
    return np.stack(rows)


@pytest.mark.parametrize("layout", ["full", "ring"])
def test_accepted_drafts_keep_the_output_and_the_caches_exact_to_the_end_of_the_context(layout):
    """With a drafter that is right most of the time (`_oracle`), rounds accept 0 to K drafts: the output still is
    plain greedy's, to the end of the context; an EOS id and max_new_tokens that fall inside a round stop it there."""
    plain = _backend(layout)
    prompt = _prompt(21)
    want = _generate(plain, prompt, n=200)
    assert plain.stats.stopped_by == "context_full"
    sequence, seen = prompt.tolist() + want, []
    spec = _backend(layout, draft=_oracle(sequence, seen))
    got = _generate(spec, prompt, n=200, speculative="assistant")
    s = spec.stats
    print(f"{layout}: {s.decode_tokens} tokens in {s.target_calls} target calls ({s.tokens_per_target_call:.2f}/call)")
    assert got == want and s.stopped_by == "context_full"
    assert s.accepted_tokens > s.target_calls and s.tokens_per_target_call > 2
    # A token's K/V computed at row 1..K of a call rounds differently from row 0 in fp32 (measured: up to 1.8e-6 for
    # one token), and later tokens attend to it: over 72 tokens the caches differ by up to 2.6e-5 (measured, full
    # layout; ring 3.3e-6), while a K/V in a wrong slot differs by the values' own size (~1).
    print(f"largest cache difference {_same_caches(plain.session, spec.session, atol=1e-4):.2e}")
    # What the drafter read: each round's first call the last token at p and the target's hidden state at p - 1,
    # each later call its previous draft and hidden_out, all at the same position.
    hidden = _hidden_by_position(layout, sequence[:-1])
    firsts = [(p, token, h) for p, j, token, h in seen if j == 0]
    assert [p for p, *_ in firsts] == sorted({p for p, *_ in firsts}) and len(firsts) >= s.target_calls - 2
    for p, token, h in firsts:
        assert token == sequence[p]
        np.testing.assert_allclose(h, hidden[p - 1], rtol=1e-4, atol=1e-4)
    for (p0, j0, _, _), (p, j, token, h) in zip(seen, seen[1:]):
        if j:
            assert p == p0 and j == j0 + 1 and (h == 10.0 * p + j0).all()
    seen.clear()
    for n in (9, 17, 30):
        assert _generate(spec, prompt, n=n, speculative="assistant") == want[:n]
    eos = want[12]
    stop = want.index(eos) + 1
    assert _generate(spec, prompt, eos=[eos], speculative="assistant") == want[:stop]
    assert spec.stats.stopped_by == "eos"


def test_seeded_speculative_sampling_repeats():
    """Sampling with the StaticDrafter (temperature, top-k, top-p on both sides): a seed repeats its tokens, another
    seed gives others."""
    backend = _backend("full")
    prompt = _prompt(13)

    def sample(seed: int) -> list[int]:
        sampling = Sampling(True, 0.8, 40, 0.95, np.random.default_rng(seed))
        return _generate(backend, prompt, sampling=sampling, speculative="assistant")

    first = sample(7)
    assert sample(7) == first and len(first) == NEW
    assert sample(8) != first
    assert backend.stats.drafter_calls > 0


# --- a variant without a drafter ----------------------------------------------------------------------------------


@pytest.fixture
def plain_artifact(tmp_path):
    """An artifact folder whose one variant has a manifest but no program: anything that loads it fails."""
    from tests.test_manifest import sample

    root, variant = tmp_path / "art", tmp_path / "art" / "fp16-ctx64"
    variant.mkdir(parents=True)
    manifest = variant / "manifest.json"
    manifest.write_text(sample().to_json())
    entry = {"path": variant.name, "soc": "SM8650", "quant": "16a8w", "context_len": 64, "mode": "kv",
             "cache_layout": "full", "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest()}
    (root / "qnn_index.json").write_text(json.dumps({"format": "optimum-qnn/variants", "version": 1,
                                                     "variants": [entry]}))
    return root


def test_speculative_assistant_on_a_plain_variant_is_refused_from_its_manifest(plain_artifact, capsys):
    """Before the files are hashed or the program loaded (the program is missing here), naming the fix."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    with pytest.raises(InvalidInputError, match=r"fp16-ctx64 was not \(it has no speculative decoding\).*--assistant"):
        QNNModelForCausalLM.from_pretrained(plain_artifact, speculative="assistant")
    code, _, err = run_main(["run", plain_artifact, "--prompt-ids", "2,40", "--speculative", "assistant"], capsys)
    assert code == 2 and "speculative='assistant' needs a variant exported for it" in err, err
    code, _, err = run_main(["run", plain_artifact, "--prompt-ids", "2,40"], capsys)
    assert code == 2 and "needs a variant exported for it" not in err  # without the request the load fails (no program)


def test_the_choices_follow_the_manifest_and_the_backend():
    """`assistant` when the manifest records a drafter and the backend runs in this process (the C++ runner has no
    drafter); a request the variant cannot serve names what it has."""
    from optimum_qnn.runtime.generation import check_speculative
    from optimum_qnn.runtime.modeling import speculative_kinds

    record = _record("draft_forward", 8)

    def manifest(lookahead=None, assistant=None):
        return SimpleNamespace(contract=SimpleNamespace(lookahead=lookahead, assistant=assistant))

    assert speculative_kinds(manifest(assistant=record), in_process=True) == ("assistant",)
    assert speculative_kinds(manifest(assistant=record), in_process=False) == ()
    assert speculative_kinds(manifest(lookahead=object()), in_process=True) == ("lookahead",)
    with pytest.raises(InvalidInputError, match=r"v1 was not \(it has only speculative='lookahead'\).*--assistant "
                                                r"REPO_OR_DIR.*C\+\+ runner has no drafter"):
        check_speculative("assistant", ("lookahead",), "v1")
    with pytest.raises(InvalidInputError, match="one of: lookahead, assistant; got 'medusa'"):
        check_speculative("medusa", ("assistant",), "v1")
    check_speculative("assistant", ("assistant",), "v1")


def test_the_model_decodes_with_its_assistant_by_default_in_chat_and_serve():
    """`QNNModelForCausalLM` over the tiny pair: `default_speculative` (what `chat` and `serve` pass) is the
    assistant; generate(speculative="assistant") gives plain greedy's ids, and its stats count both kinds of call."""
    from pathlib import Path

    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    backend = _backend("ring")
    model = QNNModelForCausalLM(Path("art"), Path("art/variant"), backend.manifest, backend)
    assert model.speculative_choices == ("assistant",) and model.default_speculative == "assistant"
    prompt = _prompt(5).tolist()
    # generate_tokens: what chat and serve call (this stand-in manifest has no tokenizer section for generate's defaults)
    got = model.generate_tokens(prompt, max_new_tokens=12, eos_token_id=[], speculative="assistant")
    s = model.stats
    assert (s.speculative, s.target_calls, s.drafter_calls, s.decode_tokens) == ("assistant", 11, 27, 11)
    assert got.tolist() == model.generate_tokens(prompt, max_new_tokens=12, eos_token_id=[]).tolist()
    assert model.stats.speculative == "" and model.stats.drafter_calls == 0


def test_the_run_stats_line_counts_target_and_drafter_calls():
    from optimum_qnn.__main__ import _speculative_stats
    from optimum_qnn.runtime.generation import GenerationStats

    s = GenerationStats(speculative="assistant", decode_tokens=12, drafted_tokens=9, accepted_tokens=6,
                        drafter_calls=9, step_times=[0.1] * 6)
    assert _speculative_stats(s) == " | assistant: 2.00 tokens per call, acceptance 67 %, 6 target + 9 drafter calls"
    assert _speculative_stats(GenerationStats()) == ""
