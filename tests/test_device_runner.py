"""`device="runner"`: ExecuTorch's C++ `qnn_llama_runner` as a subprocess of this machine (the local transport).

With `$QNN_LLAMA_RUNNER` pointing at ExecuTorch's runner built for x86, `test_executorch_runner_*` runs the real runner
against the HTP emulator and compares its greedy tokens with `device="host"` (ExecuTorch's Python runtime) on the same
.pte; without it that test is skipped and says why. `test_stand_in_runner_*` drives a stand-in runner and asserts only
what a stand-in cannot fake: the command line, the workspace and the library path the local transport gives it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from optimum_qnn.runtime.backends.device import DeviceError
from optimum_qnn.runtime.modeling import QNNModelForCausalLM

REAL_RUNNER = os.environ.get("QNN_LLAMA_RUNNER")

# Checks what the local transport hands the runner, then answers as ExecuTorch's runner does: outputs.txt = the
# --tokenized_prompt argument (its echo) + the text, inference_speed.txt, and the PyTorchObserver stdout line.
STAND_IN = """
import json, os, struct, sys
args = sys.argv[1:]
flag = lambda name: args[args.index(name) + 1]
spec = json.load(open({reply!r}))
prompt = open(flag("--tokenized_prompt"), "rb").read()
checks = {{
    "prompt": list(struct.unpack(f"<{{len(prompt) // 8}}Q", prompt)),
    "model": os.path.realpath(flag("--model_path")),
    "eval_mode": flag("--eval_mode"), "seq_len": int(flag("--seq_len")), "shared_buffer": "--shared_buffer" in args,
    "cwd": os.getcwd(), "ld": os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep),
    "backend_here": os.path.exists("libqnn_executorch_backend.so"),
    "tokenizer": os.path.exists(os.path.join(flag("--tokenizer_path"), "tokenizer.json")), "args": args,
}}
json.dump(checks, open({record!r}, "w"))
with open(flag("--output_path"), "w") as f:
    f.write(flag("--tokenized_prompt") + spec["text"])
with open(flag("--performance_output_path"), "w") as f:
    f.write("10.0")
print("PyTorchObserver " + json.dumps({{"prompt_tokens": len(checks["prompt"]), "generated_tokens": spec["n"] - 1,
      "inference_start_ms": 0, "first_token_ms": 50, "prefill_token_per_sec": 80.0, "decode_token_per_sec": 20.0}}))
"""


def _stand_in(folder: Path) -> tuple[Path, Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    reply, record = folder / "reply.json", folder / "record.json"
    runner = folder / "qnn_llama_runner"
    runner.write_text(f"#!{sys.executable}\n" + STAND_IN.format(reply=str(reply), record=str(record)))
    runner.chmod(0o755)
    (folder / "libqnn_executorch_backend.so").write_bytes(b"\x7fELF stand-in backend")
    return runner, reply, record


def _root(request, which: str) -> Path:
    if which == "fp16-hybrid":
        return request.getfixturevalue("fp16_export").output
    if which == "fp16-kv":
        return request.getfixturevalue("demo_kv_export")
    return request.getfixturevalue("a16w8_export")(which.split("-")[1])


@pytest.mark.skipif(not REAL_RUNNER, reason="QNN_LLAMA_RUNNER is unset: ExecuTorch's qnn_llama_runner (x86 build) "
                    "is not here, and only it can show that the runner generates the host's tokens")
@pytest.mark.parametrize("which", [
    "fp16-hybrid", "fp16-kv",
    pytest.param("16a8w-hybrid", marks=pytest.mark.slow), pytest.param("16a8w-kv", marks=pytest.mark.slow),
])
def test_executorch_runner_generates_the_host_tokens(which, request, demo_model_dir, tmp_path, monkeypatch, qnn_sdk):
    """ExecuTorch's qnn_llama_runner, run by the local transport on the HTP emulator, generates greedily the tokens
    that device="host" generates from the same .pte."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    root = _root(request, which)
    host = QNNModelForCausalLM.from_pretrained(root)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model = QNNModelForCausalLM.from_pretrained(root, device="runner", runner=REAL_RUNNER)
    stops = sorted(model.backend.runner_stop_ids)
    for prompt in _prompts(tok):
        got = model.generate(prompt, max_new_tokens=24)
        want = host.generate(prompt, max_new_tokens=24, eos_token_id=stops)
        print(f"{which} prompt {len(prompt)}: equal={got.tolist() == want.tolist()}, {model.stats.stopped_by}, "
              f"decode {model.stats.decode_tokens_per_s:.1f} tok/s")
        if got.tolist() != want.tolist():
            # The runner prints text, not ids: its ids are that text encoded again (runtime/backends/runner.py). Where
            # the host's greedy ids are not the tokenizer's own encoding of their text (the portable demo model's
            # second prompt ends in 202 202, which encodes as 459), the ids may differ; the text may not.
            new_got, new_want = got[0, len(prompt):].tolist(), want[0, len(prompt):].tolist()
            text = tok.decode(new_want)
            assert tok.decode(new_got) == text, model.backend.report.text
            assert tok(text, add_special_tokens=False)["input_ids"] != new_want


def _prompts(tok) -> list[list[int]]:
    return [[2] + tok("The for statement")["input_ids"],
            [2] + tok("Assignment statements are used to (re)bind names to values and to modify attributes")["input_ids"]]


@pytest.mark.parametrize("which", ["fp16-hybrid", "fp16-kv"])
def test_stand_in_runner_gets_the_argv_workspace_and_library_path_of_the_local_transport(
        which, request, demo_model_dir, tmp_path, monkeypatch, qnn_sdk):
    """A stand-in runner (not ExecuTorch's) records what the local transport hands it; only that is asserted: the
    prompt file, --seq_len, --eval_mode, the .pte, no --shared_buffer on x86, the working folder, the backend library
    and tokenizer there, this machine's QNN libraries on LD_LIBRARY_PATH. Its tokens are the test's own, so they
    prove nothing about generation (test_executorch_runner_generates_the_host_tokens does, with the real runner)."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    root = _root(request, which)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    runner, reply, record = _stand_in(tmp_path / "build")
    model = QNNModelForCausalLM.from_pretrained(root, device="runner", runner=runner)
    assert model.device_name == "runner" and model.backend.shared_buffer is False  # x86: the emulator has no RPC memory
    reply.write_text(json.dumps({"text": " is used", "n": 2}))
    for prompt in _prompts(tok):
        model.generate(prompt, max_new_tokens=24, eos_token_id=[])
        seen = json.loads(record.read_text())
        assert seen["prompt"] == prompt and seen["seq_len"] == len(prompt) + 24
        assert seen["model"] == str((model.variant / "model.pte").resolve())
        assert seen["eval_mode"] == ("1" if "hybrid" in which else "0") and not seen["shared_buffer"]
        assert seen["cwd"] == str(tmp_path / "workspace") and seen["backend_here"] and seen["tokenizer"]
        assert str(qnn_sdk.lib_dir.resolve()) in seen["ld"]  # this machine's QNN libraries (the emulator)


def test_runner_device_errors(fp16_export, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    monkeypatch.delenv("QNN_LLAMA_RUNNER", raising=False)
    with pytest.raises(DeviceError, match="No qnn_llama_runner given"):
        QNNModelForCausalLM.from_pretrained(fp16_export.output, device="runner")
    runner, reply, record = _stand_in(tmp_path / "build")
    runner.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('boom: cannot open the HTP\\n')\nsys.exit(3)\n")
    model = QNNModelForCausalLM.from_pretrained(fp16_export.output, device="runner", runner=runner)
    with pytest.raises(DeviceError, match=r"(?s)exited with status 3.*boom: cannot open the HTP"):
        model.generate([2, 40, 41], max_new_tokens=4)
    with pytest.raises(Exception, match="temperature only"):
        model.generate([2, 40], max_new_tokens=4, do_sample=True, top_k=5)


def test_runner_device_refuses_a_weight_shared_variant_on_x86(fp16_export, tmp_path, monkeypatch):
    """On x86 the runner drives the emulator, which cannot load a weight-shared context: refused before it runs."""
    import shutil

    from optimum_qnn.errors import OptimumQnnError
    from tests.test_modeling import share_weights_in_manifest

    monkeypatch.setenv("OPTIMUM_QNN_RUNNER_WORKSPACE", str(tmp_path / "workspace"))
    root = tmp_path / "copy"
    shutil.copytree(fp16_export.output, root)
    share_weights_in_manifest(root / fp16_export.variants[0].relative_to(fp16_export.output))
    runner, reply, record = _stand_in(tmp_path / "build")
    with pytest.raises(OptimumQnnError, match=r"The SM8650 variant's model.pte shares weights .*--no-weight-sharing"):
        QNNModelForCausalLM.from_pretrained(root, device="runner", runner=runner)
    assert not record.exists()  # the runner never ran
