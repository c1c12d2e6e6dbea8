"""The runtime install, for real: a fresh virtual environment with `pip install optimum-qnn[serve]` only (no torch,
no ExecuTorch, no transformers importable), running the demo exports on the x86 HTP emulator through onnxruntime-qnn.

- greedy tokens equal the ExecuTorch backend's in this (full) environment, for fp16, 16a8w and 16a4w_block exports,
  hybrid and kv, 8-bit and 4-bit embedding tables;
- a 5-turn chat's replies equal `generate` on each whole prompt, and each turn prefills only its own tokens;
- `serve` there answers the official `openai` client here, with ``cached_tokens`` > 0 on the second turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, built_once

PROMPTS = [[2, 40, 41, 42, 43, 44, 45], [2] + list(range(100, 131))]
NEW_TOKENS = 12

# The first lines of a script run in the runtime venv: it fails unless the full stack is absent there.
NO_FULL_STACK = r"""
for name in ("torch", "executorch", "transformers"):
    try:
        __import__(name)
        raise SystemExit(name + " is importable in the runtime venv")
    except ModuleNotFoundError:
        pass
"""

_SCRIPT = NO_FULL_STACK + r"""
import json, sys
from optimum_qnn import QNNModelForCausalLM
args = json.loads(sys.argv[1])
out = {}
for folder in args["folders"]:
    model = QNNModelForCausalLM.from_pretrained(folder, device="host")
    tokens = []
    for prompt in args["prompts"]:
        ids = model.generate(prompt, max_new_tokens=args["new"], eos_token_id=[])
        tokens.append(ids[0, len(prompt):].tolist())
    out[folder] = {"tokens": tokens, "device": model.device_name}
if args.get("chat"):
    class Collect:
        def __init__(self): self.tokens = []
        def put(self, value): self.tokens += [int(t) for t in value.reshape(-1).tolist()]
        def end(self): pass
    model = QNNModelForCausalLM.from_pretrained(args["chat"], device="host")
    tokenizer = model.tokenizer()
    tokenizer.chat_template = args["template"]  # short turns: five fit the small test context
    chat = model.chat(tokenizer=tokenizer, max_new_tokens=6)
    turns = []
    for text in args["turns"]:
        streamer = Collect()
        chat.send(text, streamer=streamer)
        s = chat.stats
        turns.append({"prompt": chat.input_ids[: s.prompt_tokens], "reply": streamer.tokens,
                      "reused": s.reused_tokens, "prefilled": s.prefilled_tokens})
    for turn in turns:  # the reference: each whole prompt through a fresh prefill, after the conversation
        ids = model.generate(turn["prompt"], max_new_tokens=6, eos_token_id=sorted(chat.stop_ids))
        turn["whole"] = ids[0, len(turn["prompt"]):].tolist()
        turn["whole_reused"] = model.stats.reused_tokens
    out["chat"] = turns
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="session")
def runtime_venv(tmp_path_factory) -> Path:
    """A fresh venv holding `optimum-qnn[serve]` from this checkout and its runtime requirements (from the pip cache
    where it has them)."""
    def build(folder: Path) -> Path:
        venv = folder / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        python = venv / "bin" / "python"
        proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               f"{REPO_ROOT}[serve]"], capture_output=True, text=True, timeout=1200,
                              env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QNN_SDK_ROOT")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return python

    return built_once(tmp_path_factory, "runtime-venv", build)


def _venv_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QNN_SDK_ROOT", "LD_LIBRARY_PATH")}
    env["OPTIMUM_QNN_CACHE"] = os.environ.get("OPTIMUM_QNN_CACHE", str(Path.home() / ".cache" / "optimum-qnn"))
    return env


def run_in_venv(python: Path, args: dict) -> dict:
    proc = subprocess.run([str(python), "-c", _SCRIPT, json.dumps(args)], capture_output=True, text=True,
                          timeout=1800, env=_venv_env(), cwd=python.parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _reference_tokens(folder: Path) -> list[list[int]]:
    """Greedy tokens of the ExecuTorch backend in this environment (the project's full stack)."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    model = QNNModelForCausalLM.from_pretrained(folder, device="host:executorch")
    return [model.generate(p, max_new_tokens=NEW_TOKENS, eos_token_id=[])[0, len(p):].tolist() for p in PROMPTS]


def _exports(request) -> dict[str, Path]:
    """Every mode, scheme, shard count and table kind the suite exports anyway (16a8w in kv mode is no longer one:
    its kv-mode IO is the hybrid variant's decode method, and kv mode runs here at fp16)."""
    return {
        "fp16-hybrid": request.getfixturevalue("fp16_export").output,
        "fp16-kv": request.getfixturevalue("demo_kv_export"),
        "16a8w-hybrid": request.getfixturevalue("a16w8_export")("hybrid"),
        "16a8w-2-shards": request.getfixturevalue("cli_16a8w_export")[0],
        "16a4w_block-4bit-tables": request.getfixturevalue("block4_export"),
    }


def test_runtime_venv_generates_the_executorch_tokens_and_chats(runtime_venv, request):
    exports = _exports(request)
    from tests.test_chat import COMPACT_TEMPLATE, TURNS as turns

    got = run_in_venv(runtime_venv, {"folders": [str(p) for p in exports.values()], "prompts": PROMPTS,
                                     "new": NEW_TOKENS, "chat": str(exports["fp16-hybrid"]), "turns": turns,
                                     "template": COMPACT_TEMPLATE})
    for which, folder in exports.items():
        assert got[str(folder)]["device"] == "host:onnxruntime", which  # the runtime install's default
        assert got[str(folder)]["tokens"] == _reference_tokens(folder), which
    chat = got["chat"]
    assert len(chat) == len(turns) and chat[0]["reused"] == 0
    for k, turn in enumerate(chat):
        assert turn["reply"] == turn["whole"] and turn["whole_reused"] == 0, k
        if k:  # every token the model read before is reused: only the new turn is prefilled
            read = len(chat[k - 1]["prompt"]) + len(chat[k - 1]["reply"]) - 1
            assert turn["reused"] == read and turn["prefilled"] == len(turn["prompt"]) - read, (k, turn)


def test_runtime_venv_serves_the_openai_client_with_cached_tokens(runtime_venv, a16w8_export):
    import openai

    from tests.test_server import _free_port

    port = _free_port()
    server = subprocess.Popen(
        [str(runtime_venv), "-m", "optimum_qnn", "serve", str(a16w8_export("hybrid")), "--port", str(port)],
        env=_venv_env(), cwd=runtime_venv.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        deadline = time.monotonic() + 300
        while True:
            try:
                model_id = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-3000:]
                time.sleep(0.5)
        messages = [{"role": "user", "content": "for"}]
        first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "while"}]
        second = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6)
        assert first.usage.completion_tokens > 0
        assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage
    finally:
        server.terminate()
        server.communicate(timeout=60)
