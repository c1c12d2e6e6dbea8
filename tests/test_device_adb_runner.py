"""ExecuTorch's real `qnn_llama_runner`, built for x86, behind the stand-in adb (tests/fake_adb.py) on the HTP emulator:
the tokens it generates equal the host's on the same .pte. Runs when $QNN_LLAMA_RUNNER points at such a build; the
orchestration and error tests of the phone backend are in tests/test_device_adb.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optimum_qnn.runtime.modeling import QNNModelForCausalLM
from tests.test_device_adb import phone  # noqa: F401  (the stand-in phone fixture)

REAL_RUNNER = os.environ.get("QNN_LLAMA_RUNNER")
real_runner = pytest.mark.skipif(
    not REAL_RUNNER,
    reason="QNN_LLAMA_RUNNER is not set: build ExecuTorch's qnn_llama_runner for x86 with tools/build_qnn_runner.sh "
    "(see docs/running.md, 'Run with ExecuTorch's C++ runner on this machine') and point QNN_LLAMA_RUNNER at it",
)


@pytest.fixture()
def x86_phone(phone, tmp_path, qnn_sdk) -> Path:
    """The stand-in phone set up for the x86 runner: an SDK folder whose 'Android' HTP and System libraries are
    onnxruntime-qnn's x86 ones (the HTP emulator) and whose stub, prepare and skel files are empty placeholders
    the emulator never opens; the phone shell's own library path holds onnxruntime-qnn's private libc++."""
    ort = qnn_sdk.htp_library.resolve().parent
    sdk = tmp_path / "sdk-x86"
    android = sdk / "lib/aarch64-android"
    android.mkdir(parents=True)
    for name in ("libQnnHtp.so", "libQnnSystem.so"):
        (android / name).symlink_to(ort / name)
    for name in ("lib/aarch64-android/libQnnHtpV75Stub.so", "lib/aarch64-android/libQnnHtpPrepare.so",
                 "lib/hexagon-v75/unsigned/libQnnHtpV75Skel.so"):
        (sdk / name).parent.mkdir(parents=True, exist_ok=True)
        (sdk / name).write_bytes(b"")
    phone.set(env={"LD_LIBRARY_PATH": str(ort.parent / "onnxruntime_qnn.libs")})
    return sdk


@real_runner
@pytest.mark.parametrize("which", [
    "fp16-hybrid", "fp16-kv",
    pytest.param("16a8w-hybrid", marks=pytest.mark.slow), pytest.param("16a8w-kv", marks=pytest.mark.slow),
])
def test_real_runner_generates_the_emulator_tokens(which, request, x86_phone, demo_model_dir):
    """ExecuTorch's qnn_llama_runner (x86 build) behind the stand-in adb generates, greedy, the tokens that
    QNNModelForCausalLM generates on the emulator from the same .pte (16a8w with its default uint16 IO), for prompts
    shorter and longer than the sliding window (16)."""
    from transformers import AutoTokenizer

    if which == "fp16-hybrid":
        root = request.getfixturevalue("fp16_export").output
    elif which == "fp16-kv":
        root = request.getfixturevalue("demo_kv_export")
    else:
        root = request.getfixturevalue("a16w8_export")(which.split("-")[1])
    phone_model = QNNModelForCausalLM.from_pretrained(root, device="adb", runner=REAL_RUNNER, qnn_sdk_root=x86_phone,
                                                      shared_buffer=False)
    host = QNNModelForCausalLM.from_pretrained(root)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    texts = ["The for statement", "Assignment statements are used to (re)bind names to values and to modify attributes"]
    for text in texts:
        prompt = [2] + tok(text)["input_ids"]
        got = phone_model.generate(prompt, max_new_tokens=32)
        want = host.generate(prompt, max_new_tokens=32, eos_token_id=sorted(phone_model.backend.runner_stop_ids))
        report = phone_model.backend.report
        print(f"{which} prompt {len(prompt)}: runner {got.shape[1] - len(prompt)} tokens ({phone_model.stats.stopped_by}), "
              f"equal={got.tolist() == want.tolist()}, decode {phone_model.stats.decode_tokens_per_s:.1f} tok/s, "
              f"load {report.model_load_s:.1f} s")
        assert got.tolist() == want.tolist(), (which, len(prompt), report.text)
        assert phone_model.stats.new_tokens == want.shape[1] - len(prompt) and phone_model.stats.decode_tokens_per_s > 0


@real_runner
@pytest.mark.parametrize(("quant", "ar_len"), [
    ("fp16", 4), ("fp16", 8), pytest.param("16a8w", 4, marks=pytest.mark.slow), ("16a8w", 8),
])
def test_real_runner_with_a_prefill_chunk_longer_than_the_window(quant, ar_len, window7_export, x86_phone):
    """Issue 33: over a sliding window of 7, prefill chunks of 4 and 8, prompts of 24 and 4 tokens: ExecuTorch's
    runner (which applies the window to past columns only) generates the host's greedy tokens."""
    from tests.test_window_chunks import PROMPTS

    root = window7_export(quant, ar_len)
    phone_model = QNNModelForCausalLM.from_pretrained(root, device="adb", runner=REAL_RUNNER, qnn_sdk_root=x86_phone,
                                                      shared_buffer=False)
    host = QNNModelForCausalLM.from_pretrained(root)
    for n in (24, 4):
        prompt = PROMPTS[n]
        got = phone_model.generate(prompt, max_new_tokens=16)
        want = host.generate(prompt, max_new_tokens=16, eos_token_id=sorted(phone_model.backend.runner_stop_ids))
        print(f"{quant} chunk {ar_len} prompt {n}: runner {got.shape[1] - n} tokens, equal={got.tolist() == want.tolist()}")
        assert got.tolist() == want.tolist(), (quant, ar_len, n, phone_model.backend.report.text)
