"""Every public entry point refuses a bad value with an `OptimumQnnError` subclass whose message says what to pass
instead (a plain ValueError, TypeError or AttributeError from deep inside is a bug): the walk below calls each with
bad values and checks the type, then the same through the commands (exit code 2, `error: ...`, no traceback).

Refusals of the export's arguments and of generate's are walked further in tests/test_bad_input.py."""

from __future__ import annotations

import pytest

from optimum_qnn.errors import OptimumQnnError
from tests.conftest import KV_CTX, run_main


@pytest.fixture(scope="module")
def kv_model(demo_kv_export):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    return QNNModelForCausalLM.from_pretrained(demo_kv_export)


def _calls(artifact, model_dir, kv_model, manifest):
    """(entry point and bad value, call, the fix the message must name)."""
    from transformers import AutoTokenizer

    from optimum_qnn import ExportConfig, ExportMode, QNNModelForCausalLM, QuantScheme, Soc, StaticCausalLM
    from optimum_qnn.runtime.backends.device import DeviceSpec
    from optimum_qnn.runtime.backends.runner import RunnerBackend
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.models.gemma4.loading import load_text_model

    load = QNNModelForCausalLM.from_pretrained
    hf = load_text_model(model_dir)[0]
    plain_tok = AutoTokenizer.from_pretrained(model_dir)
    plain_tok.chat_template = None  # the demo's tokenizer files carry one
    variant = f"available: SM8650/fp16/ctx{KV_CTX}/kv"
    return [
        ("from_pretrained device='gpu'", lambda: load(artifact, device="gpu"), "expected one of: host, host:executorch, host:onnxruntime, runner, adb, adb:SERIAL"),
        ("from_pretrained device=5", lambda: load(artifact, device=5), "expected one of: host, host:executorch, host:onnxruntime, runner, adb, adb:SERIAL"),
        ("from_pretrained soc=5", lambda: load(artifact, soc=5), "soc must be a non-empty string such as 'SM8650'"),
        ("from_pretrained soc='SM8550'", lambda: load(artifact, soc="SM8550"), variant),
        ("from_pretrained quant='int3'", lambda: load(artifact, quant="int3"), variant),
        ("from_pretrained context_len='64'", lambda: load(artifact, context_len="64"), "context_len must be a positive integer"),
        ("from_pretrained context_len=0", lambda: load(artifact, context_len=0), "context_len must be a positive integer"),
        ("from_pretrained revision=5", lambda: load(artifact, revision=5), "revision must be a non-empty string"),
        ("from_pretrained host runner=", lambda: load(artifact, runner="x"), "options of device='runner' or 'adb', not of the host"),
        ("from_pretrained adb bogus=", lambda: load(artifact, device="adb", bogus=1), "expected some of: qnn_sdk_root, runner"),
        ("from_pretrained 5", lambda: load(5), "Expected an artifact folder or a Hub repo id"),
        ("from_pretrained 'a/b/c'", lambda: load("a/b/c"), "check the path of the artifact"),
        ("RunnerBackend device='host'", lambda: RunnerBackend(artifact, artifact, manifest, device="host"),
         "QNNModelForCausalLM.from_pretrained(..., device='host')"),
        ("DeviceSpec.parse('gpu')", lambda: DeviceSpec.parse("gpu"), "expected one of: host, host:executorch, host:onnxruntime, runner, adb, adb:SERIAL"),
        ("generate ids out of range", lambda: kv_model.generate([2, 10**6]), "must lie in [0, 512)"),
        ("generate max_new_tokens=-1", lambda: kv_model.generate([2], max_new_tokens=-1), "an integer >= 0"),
        ("generate a prompt too long", lambda: kv_model.generate([2] * (KV_CTX + 1)), "export with a larger --max-seq-len"),
        ("text_generation chat without a template", lambda: kv_model.text_generation(plain_tok, "hi", chat=True),
         "pass chat=False (without --chat)"),
        ("from_hf 'model'", lambda: StaticCausalLM.from_hf("model", max_context_len=64), "load_text_model(folder)"),
        ("from_hf max_context_len='64'", lambda: StaticCausalLM.from_hf(hf, max_context_len="64"), "an integer >= 2"),
        ("from_hf max_context_len=10**6", lambda: StaticCausalLM.from_hf(hf, max_context_len=10**6), "choose at most"),
        ("from_hf ar_len=64", lambda: StaticCausalLM.from_hf(hf, max_context_len=64, ar_len=64), "[1, 63]"),
        ("Soc.parse('SM1')", lambda: Soc.parse("SM1"), "expected one of: SA8295, "),
        ("QuantScheme.parse('int3')", lambda: QuantScheme.parse("int3"), "expected one of: fp16"),
        ("ExportMode.parse('x')", lambda: ExportMode.parse("x"), "expected one of: kv, hybrid"),
        ("ExportConfig(mode='kv')", lambda: ExportConfig(mode="kv"), "ExportMode.parse"),
        ("export evaluate_tokens=-1", lambda: export(model_dir, artifact / "new", ExportConfig(), evaluate_tokens=-1),
         "--evaluate-tokens must be a positive integer"),
    ]


def test_public_entry_points_refuse_bad_values_with_project_errors(demo_kv_export, demo_model_dir, kv_model):
    calls = _calls(demo_kv_export, demo_model_dir, kv_model, kv_model.manifest)
    wrong = []
    for name, call, fix in calls:
        try:
            call()
        except OptimumQnnError as e:
            if fix not in str(e):
                wrong.append(f"{name}: {type(e).__name__} without {fix!r}: {e}")
        except Exception as e:  # noqa: BLE001 (the point: any other type is a bug)
            wrong.append(f"{name}: {type(e).__module__}.{type(e).__name__}: {e}")
        else:
            wrong.append(f"{name}: accepted")
    assert not wrong, "\n".join(wrong)
    assert not (demo_kv_export / "new").exists()


def test_project_errors_of_user_values_stay_value_errors():
    """Callers that caught ValueError keep working: a refused value is both."""
    from optimum_qnn.runtime.backends.device import DeviceSpec

    with pytest.raises(ValueError, match="Unknown device 'gpu'"):
        DeviceSpec.parse("gpu")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "{artifact}", "--prompt-ids", "2", "--device", "gpu"], "error: Unknown device 'gpu'; expected one of: host"),
        (["run", "{artifact}", "--prompt-ids", "2", "--soc", "SM8550"], "error: No variant for soc=SM8550"),
        (["chat", "{artifact}", "--soc", "SM8550"], "error: No variant for soc=SM8550"),
        (["serve", "{artifact}", "--port", "70000"], "error: --port must be in 1..65535"),
        (["run", "{artifact}", "--prompt-ids", "2", "--max-new-tokens", "-1"], "error: max_new_tokens must be an integer >= 0"),
        (["doctor", "{artifact}/missing"], "error: No such folder: "),
        (["inspect", "{artifact}/missing.pte"], "error: Cannot read "),
    ],
)
def test_commands_refuse_bad_values_with_their_fix(demo_kv_export, capsys, argv, message):
    """Run in this process; the logging set-up the command makes is undone."""
    code, _, err = run_main([a.format(artifact=demo_kv_export) for a in argv], capsys)
    assert code == 2, err
    assert message in err and "Traceback" not in err, err
