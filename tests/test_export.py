"""End-to-end exports of Gemma4 to QNN, run on the x86 HTP emulator against Hugging Face.

One fp16 hybrid export of the demo model is shared by the accuracy, method-agreement and delegation checks; a
16a8w export in two shards through the CLI checks the quantized path, sharding and the command line together.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch

from tests.greedy import assert_greedy_agrees
from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc

from tests.conftest import FP16_PREFILL as PREFILL
from tests.conftest import RANDOM_SOCS

# fp16 hybrid on the demo model, per-step logits SQNR against Hugging Face over 32 greedy steps: measured min 53.2
# (mean 59.6) dB for the 4-token prompt, min 48.8 (mean 59.1) dB for the 31-token one.
FP16_MIN_SQNR_DB = 46.0
# The random bf16 checkpoint's fp16 .pte against fp32 of the same weights: measured 31.3 dB over 21 tokens.
BF16_MIN_SQNR_DB = 30.0
# 16a8w hybrid on the demo model calibrated from the JSONL file, 33 tokens against fp32: measured mean SQNR 45.4 dB
# (min 34.3) and top-1 1.00 for each method alone and for prefill-then-decode; --evaluate on 189 held-out tokens:
# 43.5 dB, top-1 0.979 (the issue asks for >= 20 dB).
A16W8_MIN_SQNR_DB = 42.0
A16W8_MIN_TOP1 = 0.96


def sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-row SQNR (dB) of ``got`` against ``ref`` over the last dim."""
    return 10 * torch.log10(ref.pow(2).mean(-1) / (got - ref).pow(2).mean(-1).clamp_min(1e-30))


@pytest.fixture(scope="module")
def hf_model(demo_model_dir):
    from optimum_qnn.models.gemma4.loading import load_text_model

    return load_text_model(demo_model_dir)[0]


@pytest.fixture(scope="module")
def prompts(demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    short = [2] + tok("The for statement")["input_ids"]  # shorter than the sliding window (16)
    long = [2] + tok("Assignment statements are used to (re)bind names to values and to modify attributes")["input_ids"]
    assert len(short) < 16 < len(long) < PREFILL * 2
    return [torch.tensor(short), torch.tensor(long)]


def hf_greedy_with_logits(hf_model, prompt: torch.Tensor, n: int):
    with torch.no_grad():
        out = hf_model.generate(
            prompt.unsqueeze(0), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.cat(out.logits)


def test_fp16_greedy_matches_hf_and_logits_sqnr(fp16_model, hf_model, prompts):
    for prompt in prompts:
        ref_ids, ref_logits = hf_greedy_with_logits(hf_model, prompt, 32)
        got_ids = fp16_model.generate(prompt, max_new_tokens=32, eos_token_id=[])
        assert_greedy_agrees(got_ids[0].tolist(), ref_ids[0].tolist(), ref_logits, len(prompt))  # tests/greedy.py
        # Logits of every step: teacher-force HF's sequence through the .pte.
        session = fp16_model.backend.session
        session.reset()
        got_logits = session.feed(ref_ids[0, :-1])[len(prompt) - 1 :]
        sqnr = sqnr_db(got_logits, ref_logits)
        assert sqnr.min() >= FP16_MIN_SQNR_DB, f"per-step SQNR {sqnr.tolist()}"


def test_prefill_equals_decode_steps(fp16_model):
    """The hybrid .pte's two methods agree: N tokens through prefill == the same N tokens one by one."""
    session = fp16_model.backend.session
    ids = torch.randint(3, 500, (PREFILL,), generator=torch.Generator().manual_seed(0))
    session.reset()
    by_prefill = session.feed_method("prefill_forward", ids)
    k_prefill = [torch.from_numpy(k[..., :PREFILL].copy()) for k in session.k_bufs]  # the caches are numpy
    session.reset()
    by_decode = session.feed_method("kv_forward", ids)
    k_decode = [torch.from_numpy(k[..., :PREFILL].copy()) for k in session.k_bufs]
    assert sqnr_db(by_prefill, by_decode).min() >= 40
    for a, b in zip(k_prefill, k_decode):
        assert sqnr_db(a.flatten(), b.flatten()) >= 40


def test_every_decoder_op_runs_on_the_htp(fp16_export):
    from optimum_qnn.artifacts.manifest import read_manifest

    table = fp16_export.delegation["SM8650"]
    for line in table.splitlines()[1:]:
        method, partitions, on_qnn, on_cpu, *cpu_ops = line.split()
        # Only the two embedding lookups (tokens and per-layer tables) stay on the CPU.
        assert " ".join(cpu_ops) == "aten.embedding.default x2", line
        assert int(on_qnn) > 100
    manifest = read_manifest(fp16_export.variants[0])
    assert manifest.target.soc == "SM8650" and manifest.target.htp_arch == 75
    assert manifest.versions.qairt_build_id.startswith("v2.49.40")
    assert [m.name for m in manifest.contract.methods] == ["prefill_forward", "kv_forward"]


def test_cli_exports_16a8w_hybrid_and_quality(cli_16a8w_export, demo_model_dir):
    """16a8w hybrid in two shards through the command line. Both methods are checked against fp32 on their own (the prefill
    method once computed the logit softcap wrongly on rows 2.. after lowering, see ops/softcap.py) and together."""
    out, proc = cli_16a8w_export
    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    from optimum_qnn.quantization.calibration import CalibrationSource

    paragraphs = tiny_gemma4.corpus().split("\n\n")
    # The JSONL calibration file (the README's form) reads as the paragraphs it was written from.
    assert CalibrationSource(file=out.parent / "calib.jsonl", limit=8).texts() == [p for p in paragraphs[:40] if p.strip()][:8]
    assert "Delegation (SM8650)" in proc.stdout and "Quantization:" in proc.stdout
    # --shards 2: two QNN contexts per method, handing over through one CPU-side identity op.
    delegation = proc.stdout.split("Delegation (SM8650)")[1]
    for method in ("prefill_forward", "kv_forward"):
        assert re.search(rf"^{method} +2 +\d+ +3 +llama\.fallback\.default x1, ", delegation, re.M), delegation
    stages = proc.stdout.split("Stages:\n")[1]
    for name in ("load", "swap", "export", "calibrate", "quantize", "evaluate", "lower SM8650", "write SM8650"):
        row = re.search(rf"^{name} +\d+\.\d +(\d+) +(\d+)$", stages, re.M)
        assert row, (name, stages)
        rss, anonymous = map(int, row.groups())
        assert 0 < anonymous <= rss, (name, stages)  # the anonymous part of the RSS, torch's heap at least
    index = json.loads((out / "qnn_index.json").read_text())
    assert [v["path"] for v in index["variants"]] == ["qnn/sm8650/16a8w-ctx64"]

    from optimum_qnn import StaticCausalLM
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model

    model = QNNModelForCausalLM.from_pretrained(out)
    assert model.manifest.contract.shards == 2
    static = StaticCausalLM.from_hf(load_text_model(demo_model_dir)[0], max_context_len=64)
    ids = torch.tensor([2] + list(range(40, 72)))  # 33 tokens: two prefill calls, then one decode call
    ref = static.session().feed(ids)
    session = model.backend.session
    per_method = {}
    for method in ("prefill_forward", "kv_forward"):
        session.reset()
        per_method[method] = session.feed_method(method, ids)
    session.reset()
    mixed = session.feed(ids)
    for name, got in [*per_method.items(), ("prefill then decode", mixed)]:
        sqnr = sqnr_db(got, ref)
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"16a8w {name}: mean SQNR {sqnr.mean():.1f} dB (min {sqnr.min():.1f}), top-1 agreement {top1:.2f}")
        assert sqnr.mean() >= A16W8_MIN_SQNR_DB, name
        assert top1 >= A16W8_MIN_TOP1, name
    # The two methods run the same integer graph: they agree far better than either agrees with fp32.
    assert sqnr_db(per_method["prefill_forward"], per_method["kv_forward"]).mean() >= 30

    # --evaluate: the manifest says what quantization did, and its fp32 perplexity is Hugging Face's own loss.
    from transformers import AutoTokenizer

    from optimum_qnn.exporter.evaluation import windows
    from optimum_qnn.artifacts.model_card import model_card

    evaluation = model.manifest.evaluation
    print(f"16a8w --evaluate: {evaluation}")
    assert evaluation.text_file == "eval.txt" and evaluation.tokens == 189  # 3 windows of 63 scored tokens
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tok("\n\n".join(paragraphs[-40:]), add_special_tokens=False)["input_ids"]
    hf = load_text_model(demo_model_dir)[0]
    with torch.no_grad():
        nll = sum(hf(w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() * (w.numel() - 1) for w in windows(ids, 64, 2, 189))
    assert evaluation.perplexity_reference == pytest.approx(math.exp(nll / 189), rel=1e-3)
    assert evaluation.perplexity_exported == pytest.approx(evaluation.perplexity_reference, rel=0.05)
    assert evaluation.sqnr_db >= A16W8_MIN_SQNR_DB and evaluation.top1_agreement >= A16W8_MIN_TOP1
    assert f"({evaluation.sqnr_db:.1f} dB) on 189 tokens of `eval.txt`" in model_card(out)

    # What the user saw without -v (issue 16 item 7): one line per finished stage, a lowering progress line, and none
    # of the libraries' warnings (torchao load failures, torch pytree and ExecuTorch PassManager deprecations,
    # the quantizer's "No quant config" prints, Python warnings, QNN INFO logs).
    console = proc.stdout + proc.stderr
    noise = ("torchao", "_pytree", "register_constant", "PassManager", "No quant config", "Warning:", "LIBNATIVE",
             "[INFO]", "WARNING root", "backend_opinfo", "Deprecat", "deprecat")
    assert not [n for n in noise if n in console], [line for line in console.splitlines() if any(n in line for n in noise)]
    for name in ("load", "swap", "export", "calibrate", "quantize", "evaluate", "lower SM8650", "write SM8650"):
        assert re.search(rf"^\[{name}\] done in \d+\.\d s, peak RSS \d+ MB \(anonymous \d+ MB\)$", proc.stderr, re.M), (name, proc.stderr[-2000:])
    assert "Lowering for SM8650: 2/2 shards done" in proc.stderr  # the bar followed the two shards' compilation


def test_a_layer_reusing_kv_of_an_earlier_shard_reads_the_cache_not_a_float_copy(cli_16a8w_export):
    """The demo's layer 5 reuses the K/V of layer 2, which the 2-shard split puts in the first shard: the second
    shard's graphs take that layer's uint16 cache input and its new columns, and join them themselves; no graph
    takes a whole cache (all C columns) as float32, which would cross the host as every column in 4 bytes."""
    from optimum_qnn.artifacts.inspection import inspect_pte
    from optimum_qnn.artifacts.manifest import read_manifest

    out, _ = cli_16a8w_export
    (folder,) = [p.parent for p in out.rglob("manifest.json")]
    manifest = read_manifest(folder)
    report = inspect_pte(folder / "model.pte")
    assert len(report.contexts) == 2
    context = manifest.contract.context_len
    inputs, whole = set(), set()  # the cache inputs' shapes, and with all C columns (K [1, kv, hd, C], V [1, kv, C, hd])
    for method in manifest.contract.methods:
        for t in method.inputs:
            if t.name.startswith(("k_cache", "v_cache")):
                inputs.add(tuple(t.shape))
                shape = list(t.shape)
                shape[-1 if t.name.startswith("k") else -2] = context
                whole.add(tuple(shape))
    assert inputs and whole
    for graph in report.contexts[1].graphs:
        crossing = [(t.name, t.shape) for t in graph.inputs if t.dtype == "float32" and tuple(t.shape) in whole]
        assert not crossing, f"{graph.name} takes whole caches as float32: {crossing}"
        assert any(t.dtype == "ufixed16" and tuple(t.shape) in inputs for t in graph.inputs), graph.name


def test_cli_export_log_is_a_line_per_stage_step_and_shard(cli_16a8w_export):
    """The export's stderr is a pipe here, as a log file is (CI, nohup): progress is one line per stage, per lowering
    step and per shard, with elapsed time and RSS, never a redraw. Redrawn every second, this export wrote 121 lines
    (each carriage return is a line break here, as in a log viewer: text mode reads them as newlines); a full-size
    Gemma-4-E2B export, over 1,000."""
    _, proc = cli_16a8w_export
    lines = proc.stderr.splitlines()
    stages = [line for line in lines if re.fullmatch(r"\[[\w ]+\] done in \d+\.\d s, peak RSS \d+ MB \(anonymous \d+ MB\)", line)]
    edge = [line for line in lines if line.startswith("Preparing the graphs for QNN: ")]
    lowering = [line for line in lines if line.startswith("Lowering for SM8650: ")]
    memory = [line for line in lines if line.startswith("Memory: ")]
    assert len(stages) >= 10 and len(memory) == 1, proc.stderr  # load ... edge, lower SM8650 ... write SM8650
    assert len(lines) == len(stages) + len(edge) + len(lowering) + len(memory), proc.stderr  # nothing else, no blank
    assert all(re.search(r" \[\d\d:\d\d, RSS \d+\.\d GB\]$", line) for line in edge + lowering), edge + lowering
    # The SoC-independent steps, once, the two methods side by side (each in its own process, a step line from
    # either): per method re-export, QNN's export passes, edge dialect and edge passes; the decode method handed
    # over from its process and taken; the end.
    assert len(edge) <= 2 * 4 + 2 + 1, edge
    assert any("converting prefill_forward to the edge dialect" in line for line in edge), edge
    assert any("taking kv_forward from its process" in line for line in edge), edge
    # Per SoC: the op check; the methods' partitions proposed side by side; per method partitioning; the shards (2):
    # the first one prepared and each one compiled; serialization; the end.
    assert len(lowering) <= 1 + 1 + 2 + (1 + 2) + 1 + 1, lowering
    assert lowering[0].startswith("Lowering for SM8650: checking which ops QNN supports"), lowering
    assert any("proposing the partitions of prefill_forward, kv_forward" in line for line in lowering), lowering
    assert any("partitioning prefill_forward" in line for line in lowering), lowering
    assert len(lines) <= 31


def test_one_export_per_soc(random_kv_export):
    """--soc with several SoCs: loaded and exported once, lowered per SoC; each binary names its SoC."""
    from optimum_qnn.artifacts.inspection.pte import qnn_delegates

    result = random_kv_export
    socs = tuple(Soc.parse(s) for s in RANDOM_SOCS)
    assert [s.name for s in result.stages].count("load") == 1
    assert len(result.variants) == 3
    for soc, variant in zip(socs, result.variants):
        delegates = qnn_delegates((variant / "model.pte").read_bytes())
        assert delegates and all(t[0] == soc.value and t[1] == soc.htp_arch for d in delegates for t in d.targets), soc


def test_optimum_cli_help():
    proc = subprocess.run(
        [sys.executable, "-c", "from optimum.commands.optimum_cli import main; main()", "export", "qnn", "--help"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--soc" in proc.stdout and "SM8750" in proc.stdout and "--calib-file" in proc.stdout


def test_too_many_shards_fail_before_calibration(random_model_dir, tmp_path, monkeypatch):
    """A --shards larger than the model's layer count is refused right after the swap, not after calibration."""
    from optimum_qnn.exporter import pipeline as export_module

    def calibration_ran(*args, **kwargs):
        raise AssertionError("calibration ran before --shards was checked")

    monkeypatch.setattr(export_module, "_quantize", calibration_ran)
    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.parse("16a8w"), mode=ExportMode.KV, shapes=ShapeConfig(32, 4),
                          embedding_quant=EmbeddingQuant(8, 0), shards=99)
    with pytest.raises(ValueError, match="--shards 99 exceeds the model's"):
        export_module.export(random_model_dir, tmp_path / "out", config)
    assert not any((tmp_path / "out").rglob("model.pte"))


def test_stage_peak_rss_is_the_stage_s_own(monkeypatch):
    """Each stage reports the highest RSS while it ran, not the process's peak so far (which only grows)."""
    import optimum_qnn.exporter.pipeline as pipeline
    from optimum_qnn.exporter.pipeline import ExportResult, _rss_mb, _stage

    samplers = []

    class Seen(pipeline._RssSampler):
        def __init__(self) -> None:
            super().__init__()
            samplers.append(self)

    monkeypatch.setattr(pipeline, "_RssSampler", Seen)
    result = ExportResult(output=None)
    with _stage(result, "big"):
        block = torch.ones(64 * 2**20 // 4 * 4)  # 256 MB, touched
        held = _rss_mb()
        deadline = time.monotonic() + 120  # until the stage's sampler has seen the block, however loaded the machine
        while samplers[-1].peak < held - 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    with _stage(result, "small"):
        pass
    big, small = result.stages
    assert big.peak_rss_mb >= small.peak_rss_mb + 200, result.stage_table()
    assert small.peak_rss_mb <= _rss_mb() + 50


def test_calibration_without_tokenizer_fills_a_long_prefill_call(random_model_dir):
    """No tokenizer and a prefill call longer than 64 tokens: the random-id calibration still covers whole calls
    (it once produced 64 ids, fewer than one 80-token call, so nothing was observed and quantization failed)."""
    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.exporter.pipeline import ExportResult, _quantize
    from optimum_qnn.models.gemma4 import StaticCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model

    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.parse("16a8w"), mode=ExportMode.HYBRID, shapes=ShapeConfig(192, 80))
    static = StaticCausalLM.from_hf(load_text_model(random_model_dir)[0], max_context_len=192, ar_len=80, quantized=True)
    programs = {m.name: static.export(m.name) for m in static.contract.methods}
    result = ExportResult(output=None)
    graphs = _quantize(static, programs, config, None, CalibrationSource(), result)
    assert set(graphs) == {"prefill_forward", "kv_forward"}
    assert [s.name for s in result.stages] == ["calibrate", "quantize"]
    assert result.quant_rows


def test_bf16_checkpoint_exports_with_tables_in_stored_dtype(tmp_path, qnn_sdk):
    """A bf16 checkpoint (as Google ships Gemma4): the export keeps the embedding tables in bf16 until they are
    quantized, gives the HTP an fp32 lm_head, and the .pte matches the fp32 model of the same weights."""
    from optimum_qnn.exporter.evaluation import sqnr_db as mean_sqnr_db
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from optimum_qnn.models.gemma4 import StaticCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model
    from tests.gemma4_tiny import tiny_config, tiny_model

    folder = tmp_path / "bf16"
    tiny_model(tiny_config()).to(torch.bfloat16).save_pretrained(folder)
    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=ShapeConfig(32, 4), embedding_quant=EmbeddingQuant(0, 0))
    result = export(folder, tmp_path / "out", config)
    model = QNNModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.tensor([2] + list(range(10, 30)))
    hf = load_text_model(folder)[0]
    ref = StaticCausalLM.from_hf(hf, max_context_len=32).session().feed(ids)
    got = model.backend.session.feed(ids)
    with torch.no_grad():
        greedy = hf.generate(ids.unsqueeze(0), max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    print(f"bf16 checkpoint, fp16 .pte vs fp32: {mean_sqnr_db(got, ref):.1f} dB; stages:\n{result.stage_table()}")
    assert mean_sqnr_db(got, ref) >= BF16_MIN_SQNR_DB
    assert model.generate(ids, max_new_tokens=8, eos_token_id=[]).tolist() == greedy.tolist()


def test_defaults_fit_a_model_48_wide(tmp_path, monkeypatch, qnn_sdk):
    """Default flags on a valid Gemma4 whose width (48) is not a multiple of 32: the quantized export picks 4-bit
    tables in groups of 16 (it used to refuse: "Embedding dim 48 is not a multiple of the group size 32"), and an
    fp16 export keeps float tables. Each export stops where the next stage would start."""
    import optimum_qnn.exporter.pipeline as export_module
    import optimum_qnn.exporter.lowering as lowering
    from optimum_qnn.quantization.embedding import QuantizedEmbedding
    from tests.gemma4_tiny import tiny_config, tiny_model

    folder = tmp_path / "w48"
    tiny_model(tiny_config(hidden_size=48)).save_pretrained(folder)

    class Stop(Exception):
        pass

    seen = {}

    def stop_quantize(static, programs, config, *args):
        seen["static"], seen["programs"], seen["config"] = static, programs, config
        raise Stop

    def stop_lowering(sources, *args, **kwargs):
        seen["sources"] = sources
        raise Stop

    monkeypatch.setattr(export_module, "_quantize", stop_quantize)
    monkeypatch.setattr(lowering, "EdgeLowering", stop_lowering)
    shapes = ShapeConfig(32, 4)
    with pytest.raises(Stop):
        export_module.export(folder, tmp_path / "q", ExportConfig(quant=QuantScheme.A16W8, mode=ExportMode.KV, shapes=shapes))
    assert seen["config"].embedding_quant == EmbeddingQuant(4, 16)
    text = seen["static"].module.model
    lookups = [text.embed_tokens.lookup, text.embed_tokens_per_layer.lookup]
    assert all(isinstance(q, QuantizedEmbedding) and (q.bits, q.group_size) == (4, 16) for q in lookups)
    reference = load_hf(folder).model.embed_tokens.weight
    assert (lookups[0].dequantized_weight() - reference).abs().max() <= reference.abs().max() / 7  # 4-bit steps
    graph = seen["programs"]["kv_forward"].graph_module.code
    assert "embedding_4bit" in graph

    with pytest.raises(Stop):
        export_module.export(folder, tmp_path / "f", ExportConfig(quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=shapes))
    graph = seen["sources"]["kv_forward"].graph_module.code
    assert "aten.embedding" in graph and "quantized_decomposed" not in graph
    assert not (tmp_path / "q").exists() and not (tmp_path / "f").exists()


def load_hf(folder):
    from optimum_qnn.models.gemma4.loading import load_text_model

    return load_text_model(folder)[0]


def test_export_folder_has_its_model_card_and_no_local_path(demo_kv_export, demo_model_dir, tmp_path):
    """The artifact folder is complete as it will be published: README.md beside the index (not only on the Hub),
    and the manifest names the source model by its folder's name, never by the exporting machine's path."""
    from optimum_qnn.exporter.pipeline import source_model_id
    from optimum_qnn.artifacts.model_card import CARD_MARKER
    from optimum_qnn.artifacts.manifest import read_manifest

    card = (demo_kv_export / "README.md").read_text()
    assert CARD_MARKER in card and "`qnn/sm8650/fp16-ctx64-kv`" in card
    manifest = read_manifest(next(demo_kv_export.rglob("manifest.json")).parent)
    assert manifest.source.model_id == "demo-gemma4"
    assert str(demo_model_dir.parent) not in (next(demo_kv_export.rglob("manifest.json"))).read_text()
    assert source_model_id("google/gemma-4-e2b", demo_model_dir) == "google/gemma-4-e2b"
    snapshot = tmp_path / "hub" / "models--google--gemma-4-e2b" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert source_model_id(str(snapshot), snapshot) == "google/gemma-4-e2b"  # a Hugging Face cache snapshot


def test_model_class_is_importable_from_the_package(run_python):
    """`from optimum_qnn import QNNModelForCausalLM`, as every Optimum backend exposes its model classes; importing
    the package stays free of torch (measured: 3 ms for the package, 0.9 s more for the runtime with torch)."""
    proc = run_python(
        "-c",
        "import sys, optimum_qnn; assert 'torch' not in sys.modules, 'optimum_qnn imported torch';"
        "from optimum_qnn import QNNModelForCausalLM; print(QNNModelForCausalLM.__module__, 'QNNModelForCausalLM' in optimum_qnn.__all__)",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["optimum_qnn.runtime.modeling", "True"]
