"""`serve` and `chat` over the runner backend (ExecuTorch's ``qnn_llama_runner``), through the official `openai` client
with default parameters, over the stand-in `adb` of tests/fake_adb.py (a stand-in transport: `AdbTransport` is the
real one, the "phone" is a local folder).

Two runners drive it:
- ExecuTorch's own, when ``QNN_LLAMA_RUNNER`` names its x86 build: it runs fp16 and 16a8w exports on the HTP
  emulator, and the tests named ``test_executorch_runner_*`` check the answers end to end;
- otherwise a stand-in runner (a Python script) that answers a fixed text. It cannot fake what the server and the
  backend do, so the tests named ``test_stand_in_runner_*`` assert only that: the argv and the prompt file the
  runner is given, the requests refused before it runs, the cut at the end of a turn, and how a runner or backend
  failure reaches the client (an OpenAI-shaped error, never a traceback or a dropped connection).
"""

from __future__ import annotations

import json
import logging
import os

import openai
import pytest

from tests.test_device_adb import PREFILL, artifact, load, phone, tokenizer, write_runner, write_sdk  # noqa: F401
from tests.test_device_adb_runner import x86_phone  # noqa: F401
from tests.test_server import client, running

REAL_RUNNER = os.environ.get("QNN_LLAMA_RUNNER")
TURN_ID = 512
CTX = 96  # the context chat_artifact declares
real_runner = pytest.mark.skipif(
    not REAL_RUNNER, reason="QNN_LLAMA_RUNNER is unset: ExecuTorch's qnn_llama_runner (x86 build) is not here",
)

# The stand-in's answer: it does not stop at <turn|> itself (ExecuTorch's runner does), so a reply that ends there
# was cut by the backend's stop ids.
REPLY, AFTER = "The for statement repeats.", " And then it goes on"

# Answers like ExecuTorch's runner (outputs.txt = the --tokenized_prompt argument + the text, inference_speed.txt,
# the PyTorchObserver line), up to --seq_len, or fails as told; appends its argv and the prompt ids to calls.jsonl.
STAND_IN = """
import struct
from tokenizers import Tokenizer
args = sys.argv[1:]
flag = lambda name: args[args.index(name) + 1]
spec = json.load(open({spec!r}))
raw = open(flag("--tokenized_prompt"), "rb").read()
prompt = list(struct.unpack(f"<{{len(raw) // 8}}Q", raw))
with open({calls!r}, "a") as f:
    f.write(json.dumps({{"argv": args, "prompt": prompt}}) + "\\n")
if spec.get("exit"):
    sys.stderr.write(spec.get("stderr", "") + "\\n")
    sys.exit(spec["exit"])
tok = Tokenizer.from_file(os.path.join(flag("--tokenizer_path"), "tokenizer.json"))
ids = tok.encode(spec["text"], add_special_tokens=False).ids[: int(flag("--seq_len")) - len(prompt)]
with open(flag("--output_path"), "w") as f:
    f.write(flag("--tokenized_prompt") + tok.decode(ids, skip_special_tokens=False))
with open(flag("--performance_output_path"), "w") as f:
    f.write("12.5")
print("PyTorchObserver " + json.dumps({{"prompt_tokens": len(prompt), "generated_tokens": len(ids) - 1,
      "inference_start_ms": 0, "first_token_ms": 40, "decode_token_per_sec": 30.0}}))
"""


class StandIn:
    """The stand-in runner's instructions and what it was given."""

    def __init__(self, folder):
        self.spec, self.log = folder / "spec.json", folder / "calls.jsonl"
        self.runner = write_runner(folder / "build", STAND_IN.format(spec=str(self.spec), calls=str(self.log)))
        self.answer(REPLY + "<turn|>" + AFTER)

    def answer(self, text: str = "", **failure) -> None:
        self.spec.write_text(json.dumps({"text": text, **failure}))

    def calls(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def last(self, name: str) -> str:
        argv = self.calls()[-1]["argv"]
        return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def chat_artifact(artifact, demo_model_dir, tmp_path_factory):  # noqa: F811
    """tests/test_device_adb.py's artifact (a stand-in model.pte) with the demo tokenizer's chat template, and
    ``<turn|>`` a special token of its own (id 512, the vocabulary grown to 513) as in Gemma4's tokenizer (the demo
    tokenizer writes it as plain text), and a context of 96 (a conversation of two turns fits, the tiny vocabulary
    takes a token per few characters)."""
    import dataclasses
    import shutil

    from tokenizers import Tokenizer

    from optimum_qnn.artifacts.manifest import read_manifest

    root = tmp_path_factory.mktemp("chat") / "demo-artifact"
    shutil.copytree(artifact, root)
    shutil.copy(demo_model_dir / "chat_template.jinja", root / "chat_template.jinja")
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.add_special_tokens(["<turn|>"])
    tok.save(str(root / "tokenizer.json"))
    assert tok.token_to_id("<turn|>") == TURN_ID
    variant = root / "qnn/sm8650/fp16-ctx48"
    manifest = read_manifest(variant)
    contract = dataclasses.replace(manifest.contract, vocab_size=TURN_ID + 1, context_len=CTX)
    dataclasses.replace(manifest, contract=contract).write(variant)
    return root


@pytest.fixture()
def stand_in(phone, tmp_path, monkeypatch) -> StandIn:  # noqa: F811 - phone is a fixture
    monkeypatch.setenv("QNN_SDK_ROOT", str(write_sdk(tmp_path / "sdk")))
    made = StandIn(tmp_path)
    monkeypatch.setenv("QNN_LLAMA_RUNNER", str(made.runner))
    return made


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def test_stand_in_runner_gets_default_requests_with_the_server_s_neutral_values_and_the_limit_rule(
        chat_artifact, stand_in, tokenizer):  # noqa: F811 - fixtures
    """A plain request of the official client (no temperature, no top_p) is answered: the runner gets the server's
    default temperature 1.0 and no more than the context; max_tokens unset fills the room the runner leaves
    (C - prompt, `limits.Limits`); chat and completions, plain and streamed, give the same text; a chat reply ends
    where the turn ends (cut by the backend: the stand-in goes on past <turn|>)."""
    model = load(chat_artifact)
    with running(model) as url:
        c = client(url)
        done = c.completions.create(model="demo", prompt="abc", max_tokens=8)
        sent = stand_in.calls()[-1]["prompt"]
        assert sent == model.tokenizer()("abc", add_special_tokens=True)["input_ids"]
        assert float(stand_in.last("--temperature")) == 1.0 and int(stand_in.last("--seq_len")) == len(sent) + 8
        assert done.choices[0].text == tokenizer.decode(_ids(tokenizer, REPLY + "<turn|>")[:8])
        assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"

        chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}])
        prompt = stand_in.calls()[-1]["prompt"]
        assert int(stand_in.last("--seq_len")) == CTX  # max_tokens unset: min(256, the room of the runner's context)
        assert chat.choices[0].message.content == REPLY and chat.choices[0].finish_reason == "stop"
        assert chat.usage.prompt_tokens == len(prompt) and chat.model == "demo"
        streamed = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], stream=True)
        chunks = list(streamed)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == REPLY
        assert chunks[-1].choices[0].finish_reason == "stop"
        parts = list(c.completions.create(model="demo", prompt="abc", max_tokens=8, stream=True))
        assert "".join(p.choices[0].text for p in parts) == done.choices[0].text
        greedy = c.completions.create(model="demo", prompt="abc", max_tokens=2, temperature=0)
        assert float(stand_in.last("--temperature")) == 0.0 and greedy.usage.completion_tokens == 2


def test_stand_in_runner_is_not_run_for_what_it_cannot_honour_and_the_client_goes_on(chat_artifact, stand_in, tokenizer):  # noqa: F811
    """top_p other than 1, a seed (and top_p/seed in a stream): an OpenAI-shaped 400 naming the parameter and the
    backend; a prompt longer than the runner takes (C - AR, less than the context) a 400 context_length_exceeded;
    none of them runs the runner, and the next request on the same client is answered."""
    model = load(chat_artifact)
    with running(model) as url:
        c = client(url)
        for extra, param in ((dict(top_p=0.5), "top_p"), (dict(seed=7), "seed"), (dict(top_p=0.9, stream=True), "top_p")):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], **extra)
            assert e.value.code == "unsupported_parameter" and e.value.param == param, e.value
            assert e.value.body["message"].startswith(f"{param} is not supported by the runner (adb:PHONE1) backend")
            assert "--device host" in e.value.message
        # Between the runner's limit and the context: what the server accepted before, and the runner then refused.
        words = " ".join(["for"] * (CTX - PREFILL + 2))
        n = len(_ids(tokenizer, words)) + 1
        assert CTX - PREFILL < n < CTX, n
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="demo", prompt=words, max_tokens=2)
        assert e.value.code == "context_length_exceeded" and f"at most {CTX - PREFILL}" in e.value.message
        assert stand_in.calls() == []
        assert c.completions.create(model="demo", prompt="abc", max_tokens=3).usage.completion_tokens == 3
        assert len(stand_in.calls()) == 1


def test_stand_in_runner_failures_reach_the_client_as_openai_errors_on_a_usable_connection(
        chat_artifact, stand_in, caplog, monkeypatch):  # noqa: F811
    """The runner exits with an error, plain and streamed; then the backend raises something unexpected: each is an
    OpenAI-shaped error with a short message (no traceback), logged once, and the same client's next request is
    answered. A traceback or a dropped connection fails here (the client raises APIConnectionError, which is not an
    APIStatusError, and a cut stream is not an APIError with this message)."""
    model = load(chat_artifact)
    with running(model) as url, caplog.at_level(logging.WARNING):
        c = client(url)
        stand_in.answer(exit=3, stderr="boom: cannot open the HTP")
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="demo", prompt="abc", max_tokens=4)
        assert e.value.status_code == 500 and e.value.code == "backend_error"
        assert "exited with status 3" in e.value.message and "\n" not in e.value.message
        with pytest.raises(openai.APIError) as e:
            list(c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], stream=True))
        assert not isinstance(e.value, openai.APIConnectionError) and "exited with status 3" in e.value.message
        stand_in.answer(REPLY)
        assert c.completions.create(model="demo", prompt="abc", max_tokens=2).choices[0].text

        def unexpected(*args, **kwargs):
            raise RuntimeError("a bug in a backend")

        caplog.clear()
        with monkeypatch.context() as m:
            m.setattr(model.backend, "_run", unexpected)
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model="demo", prompt="abc", max_tokens=2)
        assert e.value.code == "internal_error" and "RuntimeError" in e.value.message
        assert "Traceback" not in e.value.message and "a bug" not in e.value.message
        logged = [r for r in caplog.records if r.exc_info and "a bug in a backend" in str(r.exc_info[1])]
        assert len(logged) == 1, [r.getMessage() for r in caplog.records]
        assert c.completions.create(model="demo", prompt="abc", max_tokens=2).choices[0].text


def test_stand_in_runner_chat_sends_the_whole_conversation_and_stops_each_reply_at_its_turn(
        chat_artifact, stand_in, tokenizer):  # noqa: F811
    """`chat` on the runner backend with its defaults: each turn sends the whole conversation (the runner keeps no
    cache), the reply ends at <turn|> (the backend's cut), and the banner names the artifact folder."""
    import io

    from transformers import AutoTokenizer

    from optimum_qnn.runtime import repl

    model = load(chat_artifact)
    hf = AutoTokenizer.from_pretrained(chat_artifact)
    stand_in.answer("Yes.<turn|>" + AFTER)
    chat = model.chat()
    out = io.StringIO()
    assert repl.run(chat, stdin=io.StringIO("Hi\nAnd?\n"), out=out) == 0
    text = out.getvalue()
    assert text.startswith("Chat with demo-artifact (") and text.count("Yes.\n") == 2 and AFTER not in text
    assert chat.stats.dropped_turns == 0
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes."},
               {"role": "user", "content": "And?"}]
    rendered = hf.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert stand_in.calls()[-1]["prompt"] == hf(rendered, add_special_tokens=False)["input_ids"]
    assert chat.stats.stopped_by == "eos" and int(stand_in.last("--seq_len")) == CTX  # max_new_tokens: the room


def test_run_chat_and_text_generation_chat_stop_at_the_turn_end_as_chat_does(chat_artifact, stand_in, capsys,
                                                                             monkeypatch):  # noqa: F811
    """`run --chat` and `text_generation(chat=True)` stop a reply at <turn|> by the conversation's stop ids
    (`stops.conversation_stop_ids`), not only at the manifest's EOS. The runner's own stop at <turn|> is taken away
    here (the stand-in does not stop either), so only the face's rule can cut the reply; without --chat it runs on."""
    from transformers import AutoTokenizer

    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from tests.conftest import run_main

    model = load(chat_artifact)
    monkeypatch.setattr(model.backend, "runner_stop_ids", frozenset(model.manifest.tokenizer.eos_ids))
    hf = AutoTokenizer.from_pretrained(chat_artifact)
    assert model.text_generation(hf, "Hi", chat=True) == REPLY and model.stats.stopped_by == "eos"
    assert model.text_generation(hf, "Hi", chat=False, max_new_tokens=40).startswith(REPLY + AFTER)
    monkeypatch.setattr(QNNModelForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: model))
    code, out, err = run_main(["run", chat_artifact, "--device", "adb", "--chat", "--prompt", "Hi"], capsys)
    assert code == 0, err
    assert out.splitlines()[0] == REPLY and "stopped by eos" in out


def test_stand_in_runner_refuses_chat_with_prompt_ids_on_the_command_line(chat_artifact, stand_in, capsys):  # noqa: F811
    from tests.conftest import run_main

    code, out, err = run_main(["run", chat_artifact, "--device", "adb", "--chat", "--prompt-ids", "2,40"], capsys)
    assert code == 2 and "--chat" in err and "--prompt-ids" in err and stand_in.calls() == []


# --- ExecuTorch's runner -------------------------------------------------------------------------------------------


@real_runner
@pytest.mark.parametrize("quant", ["fp16", pytest.param("16a8w", marks=pytest.mark.slow)])
def test_executorch_runner_serves_default_requests_and_refuses_what_it_cannot_honour(quant, request, x86_phone):  # noqa: F811
    """ExecuTorch's qnn_llama_runner (x86 build, HTP emulator) behind the stand-in adb answers the official client's
    default requests (completions and chat, plain and streamed); top_p != 1 and a seed are 400s, a prompt over the
    runner's limit a 400 context_length_exceeded, and the next request is answered."""
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM
    from tests.conftest import FP16_CTX, FP16_PREFILL

    root = request.getfixturevalue("fp16_export").output if quant == "fp16" else request.getfixturevalue("a16w8_export")("hybrid")
    model = QNNModelForCausalLM.from_pretrained(root, device="adb", runner=REAL_RUNNER, qnn_sdk_root=x86_phone,
                                                shared_buffer=False)
    tok = model.tokenizer()
    with running(model) as url:
        c = client(url)
        messages = [{"role": "user", "content": "for"}]
        done = c.completions.create(model="demo", prompt="The for statement", max_tokens=8)
        assert done.choices[0].finish_reason in ("stop", "length") and 1 <= done.usage.completion_tokens <= 8
        greedy = c.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0)
        streamed = list(c.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0,
                                                  stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == greedy.choices[0].message.content
        assert c.chat.completions.create(model="demo", messages=messages, max_tokens=4).choices[0].message is not None
        assert list(c.completions.create(model="demo", prompt="The for statement", max_tokens=4, stream=True))
        for extra, param in ((dict(top_p=0.5), "top_p"), (dict(seed=7), "seed")):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="demo", messages=messages, **extra)
            assert e.value.param == param
        # A prompt between the runner's limit (C - AR) and the context C.
        words = next(w for w in (" ".join(["for"] * k) for k in range(1, FP16_CTX))
                     if len(tok(w)["input_ids"]) > FP16_CTX - FP16_PREFILL)
        assert len(tok(words)["input_ids"]) < FP16_CTX
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="demo", prompt=words, max_tokens=2)
        assert e.value.code == "context_length_exceeded"
        assert c.completions.create(model="demo", prompt="for", max_tokens=2, temperature=0).usage.completion_tokens >= 1
