"""Lookahead decoding (`--mode lookahead`): ExecuTorch's tree layout, the host's decoding against plain greedy
decoding of the same variant (eager static graphs, then fp16 and 16a8w .pte through both host runtimes), the
refusals, and ExecuTorch's own runner with ``--eval_mode 2`` when `QNN_LLAMA_RUNNER` is set."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.lookahead import Lookahead
from optimum_qnn.ops.mask import MASK_MIN, tree_mask
from tests.conftest import run_main

SHAPE = Lookahead(ngram=5, window=4, gcap=4)  # 32 rows, AR 32: longer than the demo's window of 16
# 18 rows in AR 32: the host's session pads the call; ExecuTorch's runner cannot run it (`Lookahead.fills_ar`)
PADDED = Lookahead(ngram=4, window=3, gcap=3)
CTX, PREFILL = 96, 16
REAL_RUNNER = os.environ.get("QNN_LLAMA_RUNNER")
TEXTS = ("The for statement", "Assignment statements are used to (re)bind names to values", "In the beginning")


@pytest.fixture(scope="session")
def lookahead_export(demo_model_dir, tmp_path_factory, qnn_sdk):
    """The demo model exported once per scheme in lookahead mode (weights not shared, so the x86 emulator and
    ExecuTorch's x86 runner load it): quant -> artifact folder."""
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.quantization.calibration import CalibrationSource

    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    built = {}

    def get(quant: str):
        if quant not in built:
            out = tmp_path_factory.mktemp(f"lookahead-{quant}")
            scheme = QuantScheme.parse(quant)
            calibration = None
            if scheme.is_quantized:
                calib = out.parent / f"calib-{quant}.txt"
                calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:40]))
                calibration = CalibrationSource(file=calib, limit=8)
            config = ExportConfig(
                socs=(Soc.SM8650,), quant=scheme, mode=ExportMode.LOOKAHEAD, shapes=ShapeConfig(CTX, PREFILL),
                embedding_quant=EmbeddingQuant(8 if scheme.is_quantized else 0, 0), weight_sharing=False,
                lookahead=SHAPE,
            )
            export(demo_model_dir, out, config, calibration=calibration)
            built[quant] = out
        return built[quant]

    return get


# --- the shape and the mask ---------------------------------------------------------------------------------------


def test_shape_follows_executorchs_runner():
    """AR = next_pow2((W + G) * (N - 1)) (ExecuTorch's defaults 5/8/8: 64); the attention map and position offsets of
    lhd_token_generator for N=3, W=2, G=2: level 0 a chain, level 1 under level 0, each candidate a chain off row 0."""
    assert (Lookahead().ar_len, SHAPE.rows, SHAPE.ar_len, Lookahead(3, 2, 2).ar_len) == (64, 32, 32, 8)
    assert (PADDED.rows, PADDED.ar_len) == (18, 32)
    small = Lookahead(3, 2, 2)
    assert small.parents() == [-1, 0, 0, 1, 0, 4, 0, 6]
    assert small.offsets() == [0, 1, 1, 2, 1, 2, 1, 2]
    assert [small.verify_row(g, j) for g in range(2) for j in (1, 2)] == [4, 5, 6, 7]
    assert small.runner_args() == ["--eval_mode", "2", "--ngram", "3", "--window", "2", "--gcap", "2"]


def test_tree_mask_opens_the_cache_and_each_rows_ancestors():
    small = Lookahead(3, 2, 2)
    mask = tree_mask(small.parents(), small.offsets(), 8, 12, 2)[0, 0]
    allowed = (mask == 0).astype(int)
    assert allowed[:, :2].all() and not allowed[:, 2:4].any()  # cache slots [0, n_past) only
    assert allowed[3, 4:].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]  # row 3: rows 0, 1 and itself
    assert allowed[7, 4:].tolist() == [1, 0, 0, 0, 0, 0, 1, 1]  # candidate 1's second token: row 0, row 6, itself
    assert set(np.unique(mask)) == {0.0, MASK_MIN}
    # window 3: row 3 (position n_past + 2 = 4) no longer sees slot 1 (position 1); row 1 (position 3) still does
    windowed = (tree_mask(small.parents(), small.offsets(), 8, 12, 2, window=3)[0, 0] == 0).astype(int)
    assert windowed[3, :2].tolist() == [0, 0] and windowed[1, :2].tolist() == [0, 1]


# --- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--ngram", "3"], ["--mode", "kv", "--window", "4"], ["--gcap", "2", "--mode", "hybrid"]])
def test_a_lookahead_flag_without_lookahead_mode_is_refused_before_any_work(flags, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_main(["export", "--model", tmp_path / "no-such-model", "--output", out, *flags], capsys)
    assert code == 2 and "need --mode lookahead" in err and "add --mode lookahead, or drop them" in err, err
    assert not out.exists()


@pytest.mark.parametrize("extra, words", [
    (["--cache-layout", "ring"], "drop --cache-layout ring"),
    (["--prefill-ar-len", "32"], "choose another --prefill-ar-len"),
    (["--max-seq-len", "32", "--prefill-ar-len", "8"], "raise --max-seq-len"),
])
def test_lookahead_shapes_that_cannot_work_are_refused(extra, words, tmp_path, capsys):
    argv = ["export", "--model", tmp_path / "m", "--output", tmp_path / "out", "--mode", "lookahead",
            "--ngram", "4", "--window", "3", "--gcap", "3", "--max-seq-len", "96", *extra]
    code, _, err = run_main(argv, capsys)
    assert code == 2 and words in err, err


# --- eager static graphs: the session's tree calls and accepted K/V -----------------------------------------------


def test_eager_lookahead_equals_plain_greedy_and_keeps_the_same_caches(demo_model_dir):
    """The demo model as static modules in eager torch: lookahead decoding gives plain greedy's tokens with fewer
    decode calls, and the caches it keeps (the accepted rows' K/V only) equal plain decoding's."""
    import torch

    from optimum_qnn.models.gemma4.loading import load_text_model
    from optimum_qnn.models.gemma4.modeling import StaticCausalLM
    from optimum_qnn.runtime.generation import Sampling
    from optimum_qnn.runtime.lookahead import LookaheadDecoder
    from optimum_qnn.runtime.tokenizer import ArtifactTokenizer
    from optimum_qnn.session import KVSession, torch_method

    shape = PADDED  # rows below AR: the session pads the call
    static = StaticCausalLM.from_hf(load_text_model(demo_model_dir)[0], max_context_len=CTX, ar_len=PREFILL,
                                    decode_ar_len=shape.ar_len)
    methods = {m.name: torch_method(static.module) for m in static.contract.methods}
    prompt = np.array([2] + ArtifactTokenizer(demo_model_dir)(TEXTS[1])["input_ids"])
    greedy = Sampling()

    def session_after_prompt():
        session = KVSession(static.contract, methods)
        return session, greedy.pick(session.feed(prompt)[-1])

    plain, token = session_after_prompt()
    want = [token]
    while len(want) < 30:
        want.append(greedy.pick(plain.feed(np.array([want[-1]]))[-1]))
    lookahead, token = session_after_prompt()
    decoder = LookaheadDecoder(lookahead, shape, prompt, greedy)
    got = [token]
    while len(got) < 30:
        got += decoder.step(got[-1], 30 - len(got), eos=set())
    assert got == want
    print(f"eager: {decoder.calls} calls for 29 tokens, {decoder.accepted} guesses accepted of {decoder.drafted}")
    assert decoder.calls < 29 and decoder.accepted == 29 - decoder.calls  # some guesses were accepted
    n = lookahead.n_past
    assert n == plain.n_past == prompt.size + 29
    for k_got, k_want in zip(lookahead.k_bufs, plain.k_bufs):
        torch.testing.assert_close(torch.from_numpy(k_got[..., :n]), torch.from_numpy(k_want[..., :n]), rtol=1e-4, atol=1e-5)
    for v_got, v_want in zip(lookahead.v_bufs, plain.v_bufs):
        torch.testing.assert_close(torch.from_numpy(v_got[:, :, :n]), torch.from_numpy(v_want[:, :, :n]), rtol=1e-4, atol=1e-5)


# --- exported .pte on the x86 HTP emulator ------------------------------------------------------------------------


def _prompts(root) -> list[np.ndarray]:
    from optimum_qnn.runtime.tokenizer import ArtifactTokenizer

    tok = ArtifactTokenizer(root)
    return [np.array([2] + tok(text)["input_ids"]) for text in TEXTS]


# 16a8w in `make test-all` only (~330 s, its own lookahead export included): the host's lookahead decoding is the same
# code for every scheme, checked here at fp16; the runner's --eval_mode 2 test below runs 16a8w when a runner is built.
@pytest.mark.parametrize("quant", ["fp16", pytest.param("16a8w", marks=pytest.mark.slow)])
# Through ExecuTorch's runtime in `make test-all` only (~230 s): both runtimes drive the same InProcessBackend decoding, and
# onnxruntime's outputs are byte-identical to ExecuTorch's on the same .pte (tests/runtime/backends/test_ort_program.py).
@pytest.mark.parametrize("device", [pytest.param("host:executorch", marks=pytest.mark.slow), "host:onnxruntime"])
def test_lookahead_greedy_equals_plain_greedy_of_the_same_variant(quant, device, lookahead_export):
    """Token for token over 24 new tokens after three prompts (40 until the suite had to fit its time: each plain
    token is a call of the 32-row decode graph), on the same graphs; fewer decode calls in all, and
    the stats say so."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    root = lookahead_export(quant)
    model = QNNModelForCausalLM.from_pretrained(root, soc="SM8650", quant=quant, device=device)
    assert model.speculative_choices == ("lookahead",)
    plain_calls = lookahead_calls = 0
    for prompt in _prompts(root):
        want = model.generate(prompt, max_new_tokens=24, eos_token_id=[])
        plain_calls += model.stats.target_calls
        assert model.stats.tokens_per_target_call == 1.0 and model.stats.acceptance_rate is None
        got = model.generate(prompt, max_new_tokens=24, eos_token_id=[], speculative="lookahead")
        stats = model.stats
        print(f"{quant} {device} prompt {prompt.size}: {stats.target_calls} calls for {stats.decode_tokens} tokens "
              f"({stats.tokens_per_target_call:.2f}/call), acceptance {stats.acceptance_rate}")
        assert got.tolist() == want.tolist()
        assert stats.speculative == "lookahead" and stats.decode_tokens == 23
        assert stats.decode_tokens == stats.target_calls + stats.accepted_tokens
        lookahead_calls += stats.target_calls
    assert lookahead_calls < plain_calls


def test_manifest_records_the_shape_and_the_runner_arguments(lookahead_export):
    from optimum_qnn.artifacts.manifest import read_manifest

    (manifest_file,) = (lookahead_export("fp16") / "qnn" / "sm8650").glob("*/manifest.json")
    assert manifest_file.parent.name == "fp16-ctx96-lhd5w4g4"
    manifest = read_manifest(manifest_file)
    info = manifest.contract.lookahead
    assert (info.ngram, info.window, info.gcap, info.ar_len) == (5, 4, 4, 32)
    assert info.runner_args == ["--eval_mode", "2", "--ngram", "5", "--window", "4", "--gcap", "4"]
    assert {m.name: m.ar_len for m in manifest.contract.methods} == {"prefill_forward": PREFILL, "kv_forward": 32}


def test_run_speculative_lookahead_prints_tokens_per_call_and_acceptance(lookahead_export, capsys):
    root = lookahead_export("fp16")
    prompt = ",".join(str(t) for t in _prompts(root)[2])
    code, out, err = run_main(["run", root, "--prompt-ids", prompt, "--max-new-tokens", "30", "--speculative", "lookahead"],
                              capsys)
    assert code == 0, err
    stats = out.strip().splitlines()[-1]
    assert "lookahead: " in stats and " tokens per call, acceptance " in stats and "+ 30 new tokens" in stats, stats


def test_speculative_on_a_variant_without_it_is_refused_with_the_fix(lookahead_export):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    model = QNNModelForCausalLM.from_pretrained(lookahead_export("fp16"), soc="SM8650", quant="fp16")
    without = dataclasses.replace(model.manifest, contract=dataclasses.replace(model.manifest.contract, lookahead=None))
    plain = QNNModelForCausalLM(model.root, model.variant, without, model.backend)
    assert plain.speculative_choices == ()
    with pytest.raises(InvalidInputError, match="--mode lookahead --ngram N --window W --gcap G"):
        plain.generate([2, 40, 41], max_new_tokens=4, speculative="lookahead")
    with pytest.raises(InvalidInputError, match="one of: lookahead"):
        model.generate([2, 40, 41], max_new_tokens=4, speculative="medusa")


# --- ExecuTorch's runner -------------------------------------------------------------------------------------------


@pytest.mark.skipif(not REAL_RUNNER, reason="QNN_LLAMA_RUNNER is unset: ExecuTorch's qnn_llama_runner (x86 build: "
                    "tools/build_qnn_runner.sh) is not here, and only it can show that --eval_mode 2 generates the "
                    "host's plain greedy tokens")
@pytest.mark.parametrize("quant", ["fp16", "16a8w"])
def test_executorch_runner_in_lookahead_mode_generates_the_hosts_plain_greedy_tokens(quant, lookahead_export, tmp_path,
                                                                                     monkeypatch):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    root = lookahead_export(quant)
    host = QNNModelForCausalLM.from_pretrained(root, soc="SM8650", quant=quant)
    runner = QNNModelForCausalLM.from_pretrained(root, soc="SM8650", quant=quant, device="runner", runner=REAL_RUNNER)
    args = runner.backend.runner_args(64, 0.0)
    assert args[args.index("--eval_mode") :][:8] == SHAPE.runner_args()
    stops = sorted(runner.backend.runner_stop_ids)
    for prompt in _prompts(root):
        got = runner.generate(prompt, max_new_tokens=24)
        want = host.generate(prompt, max_new_tokens=24, eos_token_id=stops)
        assert got.tolist() == want.tolist(), runner.backend.report.text


def test_stand_in_runner_gets_executorchs_lookahead_flags(lookahead_export, tmp_path, monkeypatch, qnn_sdk):
    """device="runner" runs a lookahead variant with --eval_mode 2 and the manifest's N, W, G (a stand-in runner
    records its argv; the real runner's tokens are the test above's)."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from tests.test_device_runner import _stand_in

    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    runner, reply, record = _stand_in(tmp_path / "build")
    reply.write_text(json.dumps({"text": " is used", "n": 2}))
    model = QNNModelForCausalLM.from_pretrained(lookahead_export("fp16"), device="runner", runner=runner)
    model.generate([2, 40, 41], max_new_tokens=8, eos_token_id=[], speculative="lookahead")
    args = json.loads(record.read_text())["args"]
    assert args[args.index("--eval_mode") :][:8] == SHAPE.runner_args()


def test_runner_overshooting_the_budget_keeps_only_the_tokens_asked_for(lookahead_export, tmp_path, monkeypatch,
                                                                         qnn_sdk):
    """--eval_mode 2 accepts a step's verified tokens before it checks --seq_len, so ExecuTorch's runner can write
    more tokens than asked (measured: 27 for 24). A stand-in answers with such a text: the ids are cut to the budget,
    and the report's text to exactly those ids."""
    from optimum_qnn.runtime.backends.runner import _load_tokenizer
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from tests.test_device_runner import _stand_in

    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    root = lookahead_export("fp16")
    runner, reply, _ = _stand_in(tmp_path / "build")
    text = " statements are used to bind names to values and to modify attributes"
    tok = _load_tokenizer(Path(root))
    ids = tok.encode(text, add_special_tokens=False).ids
    asked = len(ids) - 3
    reply.write_text(json.dumps({"text": text, "n": len(ids)}))
    model = QNNModelForCausalLM.from_pretrained(root, device="runner", runner=runner)
    got = model.generate(np.array([2, 40, 41]), max_new_tokens=asked, eos_token_id=[])
    got = np.asarray(got).reshape(-1).tolist()  # prompt then new tokens
    assert got == [2, 40, 41, *ids[:asked]] and model.stats.new_tokens == asked
    assert model.stats.stopped_by == "max_new_tokens"
    kept = model.backend.report.text
    assert text.startswith(kept) and len(kept) < len(text)
    assert tok.encode(kept, add_special_tokens=False).ids == ids[:asked]


def test_a_shape_that_leaves_rows_empty_is_refused_for_the_runner_and_warned_at_export(lookahead_export, tmp_path,
                                                                                    capsys, qnn_sdk):
    """ExecuTorch's runner reads a parent for every row of the call from an attention map of `rows` entries
    (`KVManager::init_attention_mask`): N 4, W 3, G 3 (18 rows in AR 32) crashed it at 16a8w (SIGSEGV in the map's
    copy). Such a variant is refused for device="runner" before any run, and the export says it runs on the host
    backends only."""
    from optimum_qnn.artifacts.manifest import read_manifest
    from optimum_qnn.runtime.backends.runner import RunnerBackend
    from tests.test_device_runner import _stand_in

    assert SHAPE.fills_ar and SHAPE.runner_refusal() is None and Lookahead().fills_ar and not PADDED.fills_ar
    root = lookahead_export("fp16")
    (variant,) = (p.parent for p in (root / "qnn" / "sm8650").glob("*/manifest.json"))
    manifest = read_manifest(variant / "manifest.json")
    info = dataclasses.replace(manifest.contract.lookahead, ngram=4, window=3, gcap=3)
    padded = dataclasses.replace(manifest, contract=dataclasses.replace(manifest.contract, lookahead=info))
    runner, _, record = _stand_in(tmp_path / "build")
    with pytest.raises(InvalidInputError, match=r"fills 18 of the decode call's 32 rows.*device='host'"):
        RunnerBackend(root, variant, padded, device="runner", runner=runner)
    assert not record.exists()
    code, _, err = run_main(["export", "--model", tmp_path / "absent", "--output", tmp_path / "out", "--mode",
                             "lookahead", "--ngram", "4", "--window", "3", "--gcap", "3"], capsys)
    assert code == 2 and "runs on the host backends only" in err and "fills 18 of" in err, err
