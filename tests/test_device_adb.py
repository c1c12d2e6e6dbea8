"""`QNNModelForCausalLM.from_pretrained(..., device="adb")`: the phone backend, against a stand-in adb.

The stand-in (tests/fake_adb.py) only does transport: a local folder stands for the phone's filesystem and its
`shell` runs commands there with /bin/sh. The orchestration and error tests use a stand-in runner script; the
generation test uses ExecuTorch's real `qnn_llama_runner` built for x86 when $QNN_LLAMA_RUNNER points at one, with
onnxruntime-qnn's x86 libraries (whose libQnnHtp.so holds the HTP emulator) in place of QAIRT's Android ones.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from optimum_qnn.runtime.backends import DeviceError, DeviceSpec
from optimum_qnn.runtime.backends.adb import parse_devices, parse_df_available_kb
from optimum_qnn.artifacts.manifest import (
    Contract, FileEntry, Layer, Manifest, Method, Quantization, Source, Target, TensorIO, TokenizerInfo, Versions,
    file_entry,
)
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from optimum_qnn.sdk import QnnSdkError

FAKE_ADB = Path(__file__).with_name("fake_adb.py")
BUILD_ID = "v2.49.40.260810104044"
WS = "data/local/tmp/optimum_qnn"  # the phone workspace, relative to the stand-in phone's root
CTX, PREFILL = 48, 8


@dataclass
class Phone:
    """The stand-in phone: its filesystem root and the answers its adb gives."""

    root: Path
    config_path: Path
    log: Path

    def set(self, **changes) -> None:
        config = json.loads(self.config_path.read_text())
        config.update(changes)
        self.config_path.write_text(json.dumps(config))

    def calls(self, command: str | None = None) -> list[list[str]]:
        argvs = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []
        return [a[2:] if a[:1] == ["-s"] else a for a in argvs if command is None or command in a[:3]]

    def pushed(self) -> list[str]:
        return [Path(call[1]).name for call in self.calls("push")]


@pytest.fixture()
def phone(tmp_path, monkeypatch) -> Phone:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    adb = bin_dir / "adb"
    adb.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_ADB}" "$@"\n')
    adb.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    root = tmp_path / "phone"
    (root / "data/local/tmp").mkdir(parents=True)
    state = Phone(root, tmp_path / "fake_adb.json", tmp_path / "adb.log")
    state.config_path.write_text(json.dumps({
        "root": str(root), "devices": [["PHONE1", "device"]], "soc": "SM8650", "df_kb": 10**7, "env": {},
        "log": str(state.log),
    }))
    monkeypatch.setenv("FAKE_ADB_CONFIG", str(state.config_path))
    return state


def write_sdk(folder: Path, arch: int = 75, build_id: str = BUILD_ID) -> Path:
    """A QAIRT SDK layout with the Android files of one arch; the HTP library carries ``build_id``."""
    from optimum_qnn.runtime.backends.bundle import android_library_names

    for name in android_library_names(arch):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF stand-in " + (build_id.encode() if name.endswith("libQnnHtp.so") else b""))
    return folder


def write_runner(folder: Path, body: str) -> Path:
    """A stand-in runner (a Python script) with a backend library beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    runner = folder / "qnn_llama_runner"
    runner.write_text(f"#!{sys.executable}\nimport json, os, sys\n{body}\n")
    runner.chmod(0o755)
    (folder / "libqnn_executorch_backend.so").write_bytes(b"\x7fELF backend")
    return runner


# Answers like ExecuTorch's runner: outputs.txt = the --tokenized_prompt argument (its echo) + the text,
# inference_speed.txt, and the PyTorchObserver stdout line. It also records its argv and the prompt file it read.
GOOD_RUNNER = """
args = sys.argv[1:]
flag = lambda name: args[args.index(name) + 1]
spec = json.load(open({reply!r}))
json.dump({{"argv": args, "cwd": os.getcwd(), "ld": os.environ.get("LD_LIBRARY_PATH"),
           "prompt": list(open(flag("--tokenized_prompt"), "rb").read())}}, open({record!r}, "w"))
with open(flag("--output_path"), "w") as f:
    f.write(flag("--tokenized_prompt") + spec["text"])
with open(flag("--performance_output_path"), "w") as f:
    f.write("12.5")
print("PyTorchObserver " + json.dumps(spec["observer"]))
"""


@pytest.fixture(scope="module")
def artifact(demo_model_dir, tmp_path_factory) -> Path:
    """An artifact folder with the demo tokenizer and one hybrid SM8650 variant whose model.pte is a stand-in."""
    root = tmp_path_factory.mktemp("phone-artifact")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / name).write_bytes((demo_model_dir / name).read_bytes())
    variant = root / "qnn/sm8650/fp16-ctx48"
    variant.mkdir(parents=True)
    (variant / "model.pte").write_bytes(os.urandom(4096))
    program = file_entry(variant, "model.pte")
    methods = [
        Method(name, ar, [TensorIO("tokens", [1, ar], "int64")], [TensorIO("logits", [1, ar, 512], "float32")])
        for name, ar in (("prefill_forward", PREFILL), ("kv_forward", 1))
    ]
    manifest = Manifest(
        schema_version="1.0",
        source=Source("demo", None, []),
        versions=Versions("0.1.0", "1.5.1", "2.13.0", "5.23.0", BUILD_ID),
        target=Target("SM8650", 75),
        quantization=Quantization("fp16", None, "none", 32, []),
        contract=Contract(CTX, 512, 16, 0.0, -255.0, "", "", False, [Layer(0, "sliding_attention", 16, 1, 0, 0)], methods),
        tokenizer=TokenizerInfo(["tokenizer.json", "tokenizer_config.json"], 2, [1], 0, None),
        program=program,
        files=[program],
    )
    manifest.write(variant)
    entry = {"path": "qnn/sm8650/fp16-ctx48", "soc": "SM8650", "quant": "fp16", "context_len": CTX, "mode": "hybrid"}
    (root / "qnn_index.json").write_text(json.dumps({"format": "optimum-qnn/variants", "version": 1, "variants": [entry]}))
    return root


@pytest.fixture()
def tokenizer(artifact):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(artifact / "tokenizer.json"))


@pytest.fixture()
def setup(phone, tmp_path, monkeypatch):
    """A valid SDK and a stand-in runner; returns the runner's reply file and argv record."""
    monkeypatch.setenv("QNN_SDK_ROOT", str(write_sdk(tmp_path / "sdk")))
    reply, record = tmp_path / "reply.json", tmp_path / "record.json"
    runner = write_runner(tmp_path / "build", GOOD_RUNNER.format(reply=str(reply), record=str(record)))
    monkeypatch.setenv("QNN_LLAMA_RUNNER", str(runner))
    return reply, record


def load(artifact, device="adb", **options):
    return QNNModelForCausalLM.from_pretrained(artifact, device=device, **options)


def test_device_names_and_parsers():
    assert DeviceSpec.parse("adb:R5CX1") == DeviceSpec("adb", "R5CX1") and str(DeviceSpec.parse("adb")) == "adb"
    with pytest.raises(ValueError, match="expected one of: host, host:executorch, host:onnxruntime, runner, adb, adb:SERIAL"):
        DeviceSpec.parse("gpu")
    out = "* daemon started successfully\nList of devices attached\nA1\tdevice\nB2\tunauthorized\nC3\tno permissions (user x)\n\n"
    assert parse_devices(out) == [("A1", "device"), ("B2", "unauthorized"), ("C3", "no permissions")]
    toybox = "Filesystem 1K-blocks Used Available Use% Mounted on\n/dev/block/dm-40 1000 10 987 1% /data\n"
    wrapped = "Filesystem 1K-blocks Used Available Use% Mounted on\n/dev/block/very-long-name\n 1000 10 654 1% /data\n"
    assert parse_df_available_kb(toybox) == 987 and parse_df_available_kb(wrapped) == 654


def test_generate_drives_the_runner_with_token_ids(artifact, setup, phone, tokenizer):
    reply, record = setup
    text = " the statement is executed"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    observer = {"prefill_token_per_sec": 250.0, "decode_token_per_sec": 40.0, "prompt_tokens": 5,
                "generated_tokens": len(ids) - 1, "model_load_start_ms": 1000, "model_load_end_ms": 1800,
                "inference_start_ms": 2000, "first_token_ms": 2020, "inference_end_ms": 2300}
    reply.write_text(json.dumps({"text": text, "observer": observer}))
    model = load(artifact)
    assert type(model.backend).__name__ == "RunnerBackend" and model.device_name == "adb:PHONE1"
    assert sorted(phone.pushed()) == sorted([
        "qnn_llama_runner", "libqnn_executorch_backend.so", "libQnnHtp.so", "libQnnHtpV75Stub.so",
        "libQnnHtpPrepare.so", "libQnnSystem.so", "libQnnHtpV75Skel.so", "model.pte", "tokenizer.json",
        "tokenizer_config.json",
    ])
    streamed = []

    class Streamer:
        def put(self, t):
            streamed.extend(t.tolist())

        def end(self):
            streamed.append("end")

    prompt = [2, 40, 41, 42, 43]
    out = model.generate(torch.tensor(prompt), max_new_tokens=len(ids), streamer=Streamer())
    assert out.tolist() == [prompt + ids] and streamed == prompt + ids + ["end"]  # the prompt first, as transformers
    seen = json.loads(record.read_text())
    argv = seen["argv"]
    flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flags["--decoder_model_version"] == "gemma4" and flags["--eval_mode"] == "1"
    assert flags["--seq_len"] == str(len(prompt) + len(ids)) and float(flags["--temperature"]) == 0.0
    assert "--shared_buffer" in argv
    assert bytes(seen["prompt"]) == struct.pack("<5Q", *prompt)  # raw uint64 ids: no BOS added, no template
    assert Path(seen["cwd"]) == phone.root / WS and seen["ld"].split(":")[0] == str(phone.root / WS)
    s = model.stats
    assert (s.prompt_tokens, s.new_tokens, s.stopped_by) == (5, len(ids), "max_new_tokens")
    assert s.time_to_first_token_s == pytest.approx(0.02) and s.decode_tokens_per_s == 40.0
    assert model.backend.report.inference_speed == 12.5 and model.backend.report.model_load_s == pytest.approx(0.8)

    # The runner's own end tokens stop the returned sequence; the first one ends it.
    eos_text = " is<eos> more"
    eos_ids = tokenizer.encode(eos_text, add_special_tokens=False).ids
    reply.write_text(json.dumps({"text": eos_text, "observer": {**observer, "generated_tokens": len(eos_ids) - 1}}))
    out = model.generate(prompt, max_new_tokens=10)
    assert out[0, len(prompt):].tolist() == eos_ids[: eos_ids.index(1) + 1] and model.stats.stopped_by == "eos"
    assert 1 in model.backend.runner_stop_ids

    # A request past the context: --seq_len is the context length, the runner gives what fits.
    long_text = " the statement is executed, then the loop ends"
    long_ids = tokenizer.encode(long_text, add_special_tokens=False).ids
    long_prompt = [5] * (CTX - len(long_ids))
    reply.write_text(json.dumps({"text": long_text, "observer": {**observer, "generated_tokens": len(long_ids) - 1}}))
    out = model.generate(long_prompt, max_new_tokens=len(long_ids) + 10)
    assert out[0, len(long_prompt):].tolist() == long_ids and model.stats.stopped_by == "context_full"
    assert json.loads(record.read_text())["argv"][argv.index("--seq_len") + 1] == str(CTX)
    runs = len(phone.calls("shell"))
    assert model.generate(prompt, max_new_tokens=0).tolist() == [prompt] and len(phone.calls("shell")) == runs


def kv_only_copy(artifact: Path, folder: Path) -> Path:
    """The phone artifact with its variant made a kv-mode one (decode method only), the stand-in program kept."""
    import shutil

    root = folder / "kv-artifact"
    shutil.copytree(artifact, root)
    variant = root / "qnn/sm8650/fp16-ctx48"
    manifest = json.loads((variant / "manifest.json").read_text())
    manifest["contract"]["methods"] = [m for m in manifest["contract"]["methods"] if m["name"] == "kv_forward"]
    (variant / "manifest.json").write_text(json.dumps(manifest))
    index = json.loads((root / "qnn_index.json").read_text())
    index["variants"][0]["mode"] = "kv"
    (root / "qnn_index.json").write_text(json.dumps(index))
    return root


def test_phone_path_kv_variant_callers_eos_text_and_sampling(artifact, setup, phone, tokenizer, tmp_path):
    """What a phone user passes besides token ids: a kv-mode variant, their own end token, text, a temperature; and
    what the runner cannot do (top-k, top-p, a seeded generator) refused before anything runs."""
    from transformers import AutoTokenizer

    reply, record = setup
    text = " the statement is executed"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    observer = {"prompt_tokens": 3, "generated_tokens": len(ids) - 1, "decode_token_per_sec": 30.0}
    reply.write_text(json.dumps({"text": text, "observer": observer}))

    kv = load(kv_only_copy(artifact, tmp_path))
    prompt = [2, 40, 41]
    assert kv.generate(prompt, max_new_tokens=len(ids)).tolist() == [prompt + ids]
    argv = json.loads(record.read_text())["argv"]
    assert argv[argv.index("--eval_mode") + 1] == "0"  # kv mode: the runner prefills one token at a time
    from optimum_qnn.errors import ContextOverflowError

    with pytest.raises(ContextOverflowError, match=f"takes a prompt of at most {CTX - 1}"):  # no prefill chunk to leave room for
        kv.generate([5] * CTX)

    model = load(artifact)
    # A caller's end token cuts the runner's text after its first occurrence; the runner ran to the same length.
    stop = ids[2]
    out = model.generate(prompt, max_new_tokens=len(ids), eos_token_id=stop)
    assert out[0, len(prompt):].tolist() == ids[:3] and model.stats.stopped_by == "eos"
    argv = json.loads(record.read_text())["argv"]
    assert argv[argv.index("--seq_len") + 1] == str(len(prompt) + len(ids))

    # Text in, text out: the tokenizer's ids (with BOS) are the prompt file, the runner's new text comes back.
    hf = AutoTokenizer.from_pretrained(artifact)
    assert model.text_generation(hf, "The for statement", max_new_tokens=len(ids)) == text
    want = hf("The for statement", add_special_tokens=True)["input_ids"]
    assert bytes(json.loads(record.read_text())["prompt"]) == struct.pack(f"<{len(want)}Q", *want)

    # Sampling: the temperature reaches the runner; what its sampler lacks is refused without a run.
    model.generate(prompt, max_new_tokens=len(ids), do_sample=True, temperature=0.7, top_k=0)  # no top-k there
    argv = json.loads(record.read_text())["argv"]
    assert float(argv[argv.index("--temperature") + 1]) == 0.7
    runs = len(phone.calls("shell"))
    for extra in (dict(top_k=5), dict(top_p=0.9), dict(generator=torch.Generator().manual_seed(0))):
        with pytest.raises(Exception, match="temperature only"):
            model.generate(prompt, max_new_tokens=4, do_sample=True, **extra)
    assert len(phone.calls("shell")) == runs


def test_files_with_the_same_sha256_are_not_pushed_again(artifact, setup, phone, tmp_path):
    load(artifact)
    assert len(phone.pushed()) == 10
    phone.log.unlink()
    load(artifact)
    assert phone.pushed() == []
    runner = Path(os.environ["QNN_LLAMA_RUNNER"])
    runner.write_text(runner.read_text() + "\n# rebuilt\n")
    phone.log.unlink()
    load(artifact)
    assert phone.pushed() == ["qnn_llama_runner"]


def test_adb_errors(artifact, setup, phone, monkeypatch, tmp_path):
    phone.set(devices=[])
    with pytest.raises(DeviceError, match="No phone is connected .* turn on USB debugging"):
        load(artifact)
    phone.set(devices=[["A1", "device"], ["B2", "device"]])
    with pytest.raises(DeviceError, match=r"Several phones are connected \(A1 \(device\), B2 \(device\)\): pick one with device='adb:SERIAL'"):
        load(artifact)
    assert load(artifact, device="adb:B2").device_name == "adb:B2"
    assert {tuple(a[:2]) for a in map(json.loads, phone.log.read_text().splitlines()) if "push" in a} == {("-s", "B2")}
    with pytest.raises(DeviceError, match="No phone with serial 'C3'"):
        load(artifact, device="adb:C3")
    phone.set(devices=[["A1", "unauthorized"]])
    with pytest.raises(DeviceError, match="A1 is unauthorized: unlock the phone and accept"):
        load(artifact)
    phone.set(devices=[["A1", "offline"]])
    with pytest.raises(DeviceError, match="A1 is offline: reconnect"):
        load(artifact)
    with pytest.raises(ValueError, match="expected one of: host, host:executorch, host:onnxruntime, runner, adb, adb:SERIAL"):
        load(artifact, device="phone")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(DeviceError, match="adb was not found on PATH. Install Android's platform-tools"):
        load(artifact)


def test_wrong_soc_and_no_room_push_nothing(artifact, setup, phone):
    phone.set(soc="SM8550")
    with pytest.raises(DeviceError, match=r"has a SM8550, but this variant was compiled for SM8650 \(HTP v75\): load "
                                          r"the SM8550 variant \(soc='SM8550'\) or export one with --soc SM8550"):
        load(artifact)
    phone.set(soc="SM8650", df_kb=1000)
    with pytest.raises(DeviceError, match="has 1 MiB free under /data/local/tmp but needs"):
        load(artifact)
    assert phone.pushed() == []


def test_missing_runner_libraries_and_old_qairt(artifact, setup, phone, monkeypatch, tmp_path):
    runner = os.environ.pop("QNN_LLAMA_RUNNER")
    with pytest.raises(DeviceError, match="No qnn_llama_runner given.*backends/qualcomm/scripts/build.sh"):
        load(artifact)
    with pytest.raises(DeviceError, match="does not exist"):
        load(artifact, runner=tmp_path / "nowhere")
    (Path(runner).parent / "libqnn_executorch_backend.so").unlink()
    with pytest.raises(DeviceError, match="No libqnn_executorch_backend.so found beside the runner"):
        load(artifact, runner=runner)
    build = tmp_path / "build-android"  # the library where ExecuTorch's build tree has it
    lib = build / "backends/qualcomm/libqnn_executorch_backend.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF backend")
    nested = write_runner(build / "examples/qualcomm/oss_scripts/llama", "")
    (nested.parent / "libqnn_executorch_backend.so").unlink()
    assert load(artifact, runner=nested).device_name == "adb:PHONE1"
    monkeypatch.setenv("QNN_LLAMA_RUNNER", runner)
    (Path(runner).parent / "libqnn_executorch_backend.so").write_bytes(b"\x7fELF backend")

    sdk = Path(os.environ["QNN_SDK_ROOT"])
    (sdk / "lib/hexagon-v75/unsigned/libQnnHtpV75Skel.so").unlink()
    with pytest.raises(DeviceError, match=r"lacks the QAIRT Android libraries for HTP v75: .*libQnnHtpV75Skel.so"):
        load(artifact)
    monkeypatch.delenv("QNN_SDK_ROOT")
    with pytest.raises(DeviceError, match="QNN_SDK_ROOT is not set"):
        load(artifact)
    old = write_sdk(tmp_path / "old-sdk", build_id="v2.43.0.250101000000")
    with pytest.raises(QnnSdkError, match=r"compiled with QAIRT 2.49 .* runtime here is QAIRT 2.43"):
        load(artifact, qnn_sdk_root=old)
    with pytest.raises(ValueError, match="options of device='runner' or 'adb', not of the host"):
        load(artifact, device="host", runner=runner)


def test_runner_crash_reports_its_stderr(artifact, setup, phone, monkeypatch, tmp_path):
    crash = write_runner(tmp_path / "crash", (
        "sys.stderr.write('I executorch: loading\\nE executorch: Output 0 is memory planned, or is a constant. '"
        "'Cannot override the existing data pointer.\\n'); sys.exit(134)"
    ))
    model = load(artifact, runner=crash)
    with pytest.raises(DeviceError, match=r"(?s)exited with status 134.*Output 0 is memory planned"):
        model.generate([2, 40, 41], max_new_tokens=4)
    with pytest.raises(Exception, match="must lie in"):
        model.generate([2, 600])
    from optimum_qnn.errors import ContextOverflowError

    with pytest.raises(ContextOverflowError, match=f"takes a prompt of at most {CTX - PREFILL}"):
        model.generate([5] * (CTX - PREFILL + 1))
    # The same argument checks as on the host: float ids were silently truncated here before they were shared.
    from optimum_qnn.errors import InvalidInputError

    for bad, message in [
        (dict(input_ids=torch.tensor([1.5, 2.0])), "integer token ids"),
        (dict(input_ids=[[1, 2], [3, 4]]), "batch size 1"),
        (dict(input_ids=[2, 3], eos_token_id="</s>"), "eos_token_id must be an int"),
        (dict(input_ids=[2, 3], max_new_tokens=2.5), "max_new_tokens must be an integer"),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            model.generate_tokens(**bad)  # one sequence, as chat and serve ask (generate takes a batch, as HF's)


def test_run_command_streams_text_and_prints_stats(artifact, setup, phone, tokenizer, capsys):
    from optimum_qnn.__main__ import main

    reply, _ = setup
    text = " the statement is executed"
    n = len(tokenizer.encode(text, add_special_tokens=False).ids)
    observer = {"prompt_tokens": 3, "generated_tokens": n - 1, "inference_start_ms": 0, "first_token_ms": 50,
                "prefill_token_per_sec": 60.0, "decode_token_per_sec": 30.0}
    reply.write_text(json.dumps({"text": text, "observer": observer}))
    assert main(["run", str(artifact), "--prompt-ids", "2,40,41", "--max-new-tokens", str(n), "--device", "adb"]) == 0
    out = capsys.readouterr().out
    assert out == f"{text}\n[3 prompt + {n} new tokens, stopped by max_new_tokens | first token 0.05 s | prefill 60.0 tok/s | " \
           "decode 30.0 tok/s | adb:PHONE1]\n"
    assert main(["run", str(artifact), "--prompt-ids", "2,x", "--device", "adb"]) == 2
    assert main(["run", str(artifact), "--prompt-ids", "2", "--device", "adb:NOPE"]) == 2
    assert "No phone with serial 'NOPE'" in capsys.readouterr().err
