"""Bad input, as a new user gives it: every file the exporter reads corrupt or truncated, every pattern and number
at its edges, every public entry point with wrong types and shapes (issue 18). Only the project's own errors
escape, with a message that says what to do; the CLI exits 2; a failed export leaves the output folder as it was.

Most checks run the CLI in this process (`python -m optimum_qnn export` is `main([...])`): they fail before any
model is loaded, so they cost milliseconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from optimum_qnn.errors import InvalidInputError, OptimumQnnError
from tests.conftest import KV_CTX, run_main
from tests.test_reliability import snapshot


@pytest.fixture
def model_copy(demo_model_dir, tmp_path) -> Path:
    """A copy of the demo checkpoint folder, to damage."""
    folder = tmp_path / "model"
    shutil.copytree(demo_model_dir, folder)
    return folder


def cli(capsys, model, output, *argv) -> tuple[int, str]:
    """Run the export CLI in this process; returns (exit code, stderr). The logging set-up it makes is undone."""
    code, _, err = run_main(["export", "--model", model, "--output", output, "--mode", "kv", "--max-seq-len", "32", *argv], capsys)
    assert "Traceback" not in err, err
    return code, err


def refused(capsys, model, tmp_path, *argv, match: str) -> str:
    """The CLI refuses with exit code 2, ``match`` in its message, and creates no output folder."""
    out = tmp_path / "new" / "out"
    code, err = cli(capsys, model, out, *argv)
    assert code == 2, err
    assert match in err, err
    assert not (tmp_path / "new").exists(), "a failed export left the folder it created"
    return err


# --- the table ------------------------------------------------------------------------------------------

def test_truncated_safetensors_is_named_as_a_corrupt_download(model_copy, tmp_path, capsys):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = refused(capsys, model_copy, tmp_path, match=f"{weights} cannot be read")
    assert "corrupt or an incomplete download" in err and "Download the model again" in err
    weights.write_bytes(b"\x05")  # shorter than a safetensors header
    refused(capsys, model_copy, tmp_path, match="corrupt or an incomplete download")


def test_invalid_override_pattern_is_named_before_anything_loads(demo_model_dir, tmp_path, capsys, monkeypatch):
    import optimum_qnn.exporter.pipeline as export_module

    monkeypatch.setattr(export_module, "load_text_model", lambda *a, **k: pytest.fail("the model was loaded"))
    err = refused(capsys, demo_model_dir, tmp_path, "--quant-override", "([=16a8w", match="'([' is not a valid regular expression")
    assert "escape special characters" in err


@pytest.mark.parametrize(
    "damage, match",
    [
        ("missing", "No such folder"),
        ("unsupported", "Model type 'llama' is not supported"),
        ("no_config", "No config.json in"),
        ("context", "--max-seq-len 4096 exceeds the model's max_position_embeddings (1024)"),
    ],
)
def test_failed_export_removes_what_it_created_and_nothing_else(model_copy, tmp_path, capsys, damage, match):
    argv = ()
    if damage == "missing":
        model_copy = tmp_path / "does-not-exist" / "model"
    elif damage == "unsupported":
        (model_copy / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif damage == "no_config":
        (model_copy / "config.json").unlink()
    else:
        argv = ("--max-seq-len", "4096")
    refused(capsys, model_copy, tmp_path, *argv, match=match)
    # An existing folder with other content stays exactly as it was.
    existing = tmp_path / "existing"
    (existing / "qnn" / "sm8650" / "other").mkdir(parents=True)
    (existing / "qnn" / "sm8650" / "other" / "model.pte").write_bytes(b"keep")
    (existing / "notes.txt").write_text("mine")
    before = snapshot(existing)
    dirs = sorted(p for p in existing.rglob("*"))
    code, err = cli(capsys, model_copy, existing, *argv)
    assert code == 2 and match in err, err
    assert snapshot(existing) == before and sorted(existing.rglob("*")) == dirs


def test_calibration_jsonl_text_must_be_a_string(demo_model_dir, tmp_path, capsys):
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"text": "a real sentence"}\n{"text": 5}\n')
    refused(capsys, demo_model_dir, tmp_path, "--quant", "16a8w", "--calib-file", str(calib),
            match=f"{calib}:2: the 'text' field is int 5, not a string")


def test_too_few_calibration_tokens_are_reported(demo_model_dir, monkeypatch, caplog, qnn_sdk):
    """One short sample sets the activation ranges from a handful of rows: the export says how many tokens it had."""
    import optimum_qnn.quantization.shared as quantization
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig
    from optimum_qnn.exporter.pipeline import ExportResult, _quantize
    from optimum_qnn.exporter.preflight import load_tokenizer
    from optimum_qnn.models.gemma4 import StaticCausalLM
    from optimum_qnn.models.gemma4.loading import load_text_model

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(quantization, "quantize_shared", stop)
    config = ExportConfig(quant=QuantScheme.A16W8, mode=ExportMode.KV, shapes=ShapeConfig(32, 4))
    static = StaticCausalLM.from_hf(load_text_model(demo_model_dir)[0], max_context_len=32, quantized=True)
    with pytest.raises(Stop):
        _quantize(static, {}, config, load_tokenizer(demo_model_dir), ["The for statement"], ExportResult(None))
    (warning,) = [r.getMessage() for r in caplog.records if "Calibrating on only" in r.getMessage()]
    assert "1 samples" in warning and "--calib-file" in warning, warning
    tokens = int(warning.split("on only ")[1].split()[0])
    assert 2 <= tokens < 64


@pytest.fixture(scope="module")
def kv_model(demo_kv_export):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    return QNNModelForCausalLM.from_pretrained(demo_kv_export)


@pytest.mark.parametrize(
    "input_ids, kwargs, match",
    [
        (torch.tensor([1.5, 2.0]), {}, "integer token ids; got a float32 torch tensor"),
        (torch.ones(1, 2, 2, dtype=torch.long), {}, r"shape \(1, 2, 2\)"),
        (torch.tensor([True, False]), {}, "got a bool torch tensor"),
        (["a", "b"], {}, "input_ids must be token ids"),
        ([[1, 2], [3]], {}, "rows of different lengths need padding and an attention_mask"),
        ([2, 3], dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\]"),
        ([2, 3], dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
        ([2, 3], dict(do_sample=True, top_k=-1), "top_k must be an integer >= 0"),
        ([2, 3], dict(do_sample=True, temperature=float("nan")), "temperature must be a finite number > 0"),
        ([2, 3], dict(do_sample=True, temperature=0), "temperature must be a finite number > 0"),
        ([2, 3], dict(do_sample="yes"), "do_sample must be True or False"),
        ([2, 3], dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 0; got 2.5"),
        ([2, 3], dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
        ([2, 3], dict(eos_token_id="</s>"), "eos_token_id must be an int, a list of ints or None"),
        ([2, -1], {}, r"Token ids must lie in \[0, 512\)"),
        ([2, 3], dict(streamer=print), "streamer must have put"),
        ([2, 3], dict(do_sample=True, generator=0), "generator must be a numpy.random.Generator or a torch.Generator"),
    ],
)
def test_generate_refuses_bad_input(kv_model, input_ids, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        kv_model.generate(input_ids, **kwargs)


def test_generate_accepts_a_batch_of_one_and_a_list(kv_model):
    a = kv_model.generate(torch.tensor([[2, 40, 41]]), max_new_tokens=2, eos_token_id=[])
    b = kv_model.generate([2, 40, 41], max_new_tokens=2, eos_token_id=[], do_sample=True, top_p=1.0, top_k=0,
                          temperature=1e-6, generator=torch.Generator().manual_seed(0))
    assert a.tolist() == b.tolist() and a.shape == (1, 5)


def test_text_generation_refuses_wrong_types(kv_model, demo_model_dir):
    from transformers import AutoTokenizer

    with pytest.raises(InvalidInputError, match="prompt must be a string"):
        kv_model.text_generation(AutoTokenizer.from_pretrained(demo_model_dir), [2, 3])
    with pytest.raises(InvalidInputError, match="tokenizer must be a tokenizer"):
        kv_model.text_generation(None, "hello")


def test_from_pretrained_on_a_missing_path_or_a_file(demo_kv_export, tmp_path):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    with pytest.raises(OptimumQnnError, match="No such folder: /path/that/does/not/exist. It is not a Hub repo id"):
        QNNModelForCausalLM.from_pretrained("/path/that/does/not/exist")
    with pytest.raises(OptimumQnnError, match="No such folder: out/a/b"):
        QNNModelForCausalLM.from_pretrained("out/a/b")
    pte = next(demo_kv_export.rglob("model.pte"))
    with pytest.raises(OptimumQnnError, match="is a file; pass the artifact folder"):
        QNNModelForCausalLM.from_pretrained(pte)
    with pytest.raises(InvalidInputError, match="Expected an artifact folder or a Hub repo id; got 5"):
        QNNModelForCausalLM.from_pretrained(5)


def test_corrupt_index_and_manifest_are_project_errors(demo_kv_export, tmp_path):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    root = tmp_path / "artifact"
    shutil.copytree(demo_kv_export, root)
    (root / "qnn_index.json").write_text('{"format": "optimum-qnn/varia')
    with pytest.raises(OptimumQnnError, match="Cannot read the variant index"):
        QNNModelForCausalLM.from_pretrained(root)
    shutil.copy(demo_kv_export / "qnn_index.json", root / "qnn_index.json")
    manifest = next(root.rglob("manifest.json"))
    manifest.write_text(manifest.read_text()[:100])
    with pytest.raises(OptimumQnnError, match="Cannot read manifest"):
        QNNModelForCausalLM.from_pretrained(root)


# --- beyond the table: every file the exporter reads ----------------------------------------------------------

@pytest.mark.parametrize(
    "damage, match",
    [
        ("config_json", "config.json cannot be read"),
        ("config_list", "expected a JSON object, got list"),
        ("config_value", "config.json is not a valid Gemma4 config (StrictDataclassFieldValidationError: Validation error for field 'hidden_size'"),
        ("layer_types", "`num_hidden_layers` (6) must be equal to the number of `layer_types` (2)); fix the value"),
        ("config_zero", "max_position_embeddings must be a positive integer; got 0"),
        ("index_json", "model.safetensors.index.json cannot be read"),
        ("index_missing_shard", "lists weight files that are missing: model-00002-of-00002.safetensors"),
        ("tokenizer", "The tokenizer in"),
        ("empty_weights", "corrupt or an incomplete download"),
    ],
)
def test_corrupt_checkpoint_files(model_copy, tmp_path, capsys, damage, match):
    config_path = model_copy / "config.json"
    config = json.loads(config_path.read_text())
    if damage == "config_json":
        config_path.write_text(config_path.read_text()[:50])
    elif damage == "config_list":
        config_path.write_text("[1, 2]")
    elif damage == "config_value":
        config_path.write_text(json.dumps({**config, "hidden_size": "wide"}))
    elif damage == "config_zero":
        config_path.write_text(json.dumps({**config, "max_position_embeddings": 0}))
    elif damage == "layer_types":
        config_path.write_text(json.dumps({**config, "layer_types": config["layer_types"][:2]}))
    elif damage == "index_json":
        (model_copy / "model.safetensors.index.json").write_text("{")
    elif damage == "index_missing_shard":
        (model_copy / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
        ))
    elif damage == "tokenizer":
        tok = model_copy / "tokenizer.json"
        tok.write_text(tok.read_text()[: 200])
    else:
        (model_copy / "model.safetensors").write_bytes(b"")
    refused(capsys, model_copy, tmp_path, match=match)


def test_weights_of_another_model_are_named(model_copy, tmp_path, capsys):
    """A config.json from a wider model than its weights: the shapes are compared before anything is assigned."""
    config_path = model_copy / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    err = refused(capsys, model_copy, tmp_path, match="do not have the shape its config.json gives")
    assert "mlp" in err and "different models" in err


@pytest.mark.parametrize(
    "argv, match",
    [
        (("--calib-limit", "0"), "--calib-limit must be a positive integer; got 0"),
        (("--evaluate-tokens", "0", "--evaluate", "README.md"), "--evaluate-tokens must be a positive integer; got 0"),
        (("--embedding-quant", "4,32,1"), "Cannot parse embedding quantization '4,32,1'"),
        (("--embedding-quant", "4,x"), "Cannot parse embedding quantization '4,x'"),
        (("--embedding-quant", "4,-8"), "group size must be >= 0"),
        (("--embedding-quant", "4,48"), "128 wide, not a multiple of the group size 48; choose a group size of 16 or 32,"),
        (("--quant", "16a8w", "--quant-override", "=16a8w"), "expected REGEX=SCHEME"),
        (("--quant", "16a8w", "--quant-override", "lm_head=fp16"), "expected a quantized scheme"),
        (("--quant", "16a8w", "--quant-override", "lm_head=16a9w"), "Unknown quant scheme '16a9w'"),
        (("--quant", "16a4w_block", "--block-size", "48"), "invalid choice: 48"),
        (("--shards", "7"), "--shards 7 exceeds the model's 6 decoder layers"),
        (("--shards", "-1"), "shards must be at least 1; got -1"),
        (("--max-seq-len", "-5"), "must be positive"),
        (("--max-seq-len", "1"), "max_seq_len must be at least 2"),
        (("--revision", "main"), "selects a Hub revision, but"),
        (("--push-to-hub", "not a repo"), "--push-to-hub 'not a repo' is not a Hub repo id"),
        (("--soc",), "expected at least one argument"),
    ],
)
def test_bad_numbers_and_patterns_fail_before_the_model_loads(demo_model_dir, tmp_path, capsys, monkeypatch, argv, match):
    import optimum_qnn.exporter.pipeline as export_module

    monkeypatch.setattr(export_module, "load_text_model", lambda *a, **k: pytest.fail("the model was loaded"))
    try:
        err = refused(capsys, demo_model_dir, tmp_path, *argv, match=match)
    except SystemExit as e:  # argparse's own errors (also exit code 2)
        assert e.code == 2
        err = capsys.readouterr().err
        assert match in err, err
        assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "content, name, match",
    [
        (b"\xff\xfe\x00binary", "calib.txt", "is not UTF-8 text"),
        (b"\n\n  \n", "calib.txt", "No calibration text found"),
        (b"[1, 2]\n", "calib.jsonl", "calib.jsonl:1: expected a JSON object with a 'text' field"),
        (b'{"text": "ok"}\n{"text": "cut', "calib.jsonl", "calib.jsonl:2: expected a JSON object"),
        (None, "missing.txt", "Calibration file"),
        (None, "", "(it is a folder)"),
    ],
)
def test_bad_calibration_files(demo_model_dir, tmp_path, capsys, content, name, match):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    refused(capsys, demo_model_dir, tmp_path, "--quant", "16a8w", "--calib-file", str(path), match=match)


def test_bad_evaluation_file(demo_model_dir, tmp_path, capsys):
    empty = tmp_path / "eval.txt"
    empty.write_text("\n\n")
    refused(capsys, demo_model_dir, tmp_path, "--quant", "fp16", "--no-weight-sharing", "--evaluate", str(empty),
            match="holds no text")


def test_calibration_text_without_a_tokenizer_is_refused(model_copy, tmp_path, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink()
    calib = tmp_path / "calib.txt"
    calib.write_text("some text")
    refused(capsys, model_copy, tmp_path, "--quant", "16a8w", "--calib-file", str(calib), match="has no tokenizer")


def test_override_matching_no_module_is_refused_before_calibration(demo_model_dir, tmp_path, monkeypatch):
    import optimum_qnn.exporter.pipeline as export_module
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig

    monkeypatch.setattr(export_module, "_quantize", lambda *a, **k: pytest.fail("calibration ran"))
    config = ExportConfig(quant=QuantScheme.A16W8, mode=ExportMode.KV, shapes=ShapeConfig(32, 4),
                          overrides=(("lm_haed", QuantScheme.A16W16),))
    with pytest.raises(InvalidInputError, match=r"--quant-override lm_haed=16a16w matches no module.*lm_head"):
        export_module.export(demo_model_dir, tmp_path / "out", config)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, o, c: ("export", 123, o, c), "model must be a Hub id or a folder path; got 123"),
        (lambda m, o, c: ("export", m, None, c), "output must be a folder path; got None"),
        (lambda m, o, c: ("export", m, o, "fp16"), "config must be an ExportConfig; got str"),
        (lambda m, o, c: ("config", dict(quant="16a8w")), "ExportConfig.quant must be a QuantScheme; got str"),
        (lambda m, o, c: ("config", dict(socs=("SM8650",))), r"must hold Soc members \(Soc.parse"),
        (lambda m, o, c: ("config", dict(shards=1.5)), "shards must be at least 1; got 1.5"),
        (lambda m, o, c: ("config", dict(overrides=("lm_head",))), "must be a \\(regex, QuantScheme\\) pair"),
        (lambda m, o, c: ("shape", (64.0, 8)), "must be integers"),
        (lambda m, o, c: ("embedding", ("4", 32)), "bits and group size must be integers"),
        (lambda m, o, c: ("calib", dict(limit=True)), "--calib-limit must be a positive integer; got True"),
    ],
)
def test_python_api_wrong_types(demo_model_dir, tmp_path, call, match):
    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ShapeConfig
    from optimum_qnn.exporter.pipeline import export

    kind, *args = call(demo_model_dir, tmp_path / "out", ExportConfig())
    with pytest.raises(InvalidInputError, match=match):
        if kind == "export":
            export(*args)
        elif kind == "config":
            ExportConfig(**args[0])
        elif kind == "shape":
            ShapeConfig(*args[0])
        elif kind == "embedding":
            EmbeddingQuant(*args[0])
        else:
            CalibrationSource(**args[0])
    assert not (tmp_path / "out").exists()


def test_interrupted_export_removes_the_folder_it_created(demo_model_dir, tmp_path, monkeypatch):
    """Ctrl-C (or any crash) after the output folder was made: the folder goes too."""
    import optimum_qnn.exporter.pipeline as export_module
    from optimum_qnn.config import ExportConfig, ExportMode, QuantScheme, ShapeConfig

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module.StaticCausalLM, "from_hf", interrupt)
    config = ExportConfig(quant=QuantScheme.FP16, mode=ExportMode.KV, shapes=ShapeConfig(KV_CTX, 4))
    with pytest.raises(KeyboardInterrupt):
        export_module.export(demo_model_dir, tmp_path / "a" / "b", config)
    assert not (tmp_path / "a").exists()


def test_output_that_is_a_file(demo_model_dir, tmp_path, capsys):
    target = tmp_path / "out"
    target.write_text("a file")
    code, err = cli(capsys, demo_model_dir, target)
    assert code == 2 and "Cannot write to the output folder" in err and "Choose a writable --output folder" in err, err
    assert target.read_text() == "a file"
