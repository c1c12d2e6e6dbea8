"""The OpenAI-compatible server, through the official `openai` client over real HTTP on loopback, with the demo
model on the HTP emulator: chat and text completions (streamed and not), stop strings, seeds, usage, errors, the
queue limit, a client leaving mid-stream, the API key, prefix reuse across requests, and `serve` stopped by SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import FP16_CTX, REPO_ROOT, child_env

MESSAGES = [{"role": "user", "content": "for"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(model, **options):
    """The app for ``model`` on a uvicorn server in a thread of this process, on loopback; stopped on exit."""
    import uvicorn

    from optimum_qnn.runtime.server.app import build_app

    port = _free_port()
    app = build_app(model, name="demo", **options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(fp16_model):
    with running(fp16_model, queue_size=4) as url:
        yield url


def test_models_and_an_unknown_model(server):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["demo"]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert e.value.code == "model_not_found" and "'demo'" in e.value.message


def test_chat_streamed_equals_unstreamed_with_usage(server, fp16_model):
    c = client(server)
    full = c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    tok = fp16_model.tokenizer()
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert full.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert 1 <= full.usage.completion_tokens <= 8
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == choice.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices


def test_completions_and_stop_strings(server):
    c = client(server)
    full = c.completions.create(model="demo", prompt="The for statement is used to", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and len(text) > 6
    stop = text[3:6]  # a stop string that appears after the third character
    cut = text.index(stop)
    stopped = c.completions.create(model="demo", prompt="The for statement is used to", max_tokens=16, temperature=0,
                                   stop=[stop, "zzzz-never"])
    assert stopped.choices[0].text == text[:cut] and stopped.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="demo", prompt="The for statement is used to", max_tokens=16, temperature=0,
                                    stop=stop, stream=True)
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == text[:cut] and parts[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_reply(server):
    c = client(server)

    def sample(seed: int) -> str:
        return c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed,
                                         top_p=0.95).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_a_second_request_sharing_the_history_prefills_only_its_new_tokens(server):
    c = client(server)
    one = c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=6, temperature=0)
    history = MESSAGES + [{"role": "assistant", "content": one.choices[0].message.content},
                          {"role": "user", "content": "if x:"}]
    two = c.chat.completions.create(model="demo", messages=history, max_tokens=6, temperature=0)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert one.usage.prompt_tokens <= cached < two.usage.prompt_tokens, (one.usage, two.usage)
    health = httpx.get(f"{server}/health").json()
    assert health["last_generation"]["cached_tokens"] == cached


def test_errors_in_openai_shape(server, fp16_model):
    c = client(server)
    long = [{"role": "user", "content": " ".join(["for while if"] * 80)}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="demo", messages=long, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and f"maximum context length is {FP16_CTX}" in e.value.message
    with pytest.raises(openai.BadRequestError, match="n=2"):
        c.chat.completions.create(model="demo", messages=MESSAGES, n=2)
    bad = httpx.post(f"{server}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    huge = httpx.post(f"{server}/v1/completions", content=b"x" * (2 << 20))
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_mid_stream_stops_its_generation(server):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={"model": "demo", "prompt": "The for statement", "max_tokens": 80, "temperature": 0,
                            "stream": True}) as response:
        lines = response.iter_lines()
        got = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
        assert got and json.loads(got[0][5:])["object"] == "text_completion"
    deadline = time.monotonic() + 60
    while (health := httpx.get(f"{server}/health").json())["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    last = health["last_generation"]
    assert last["stopped_by"] == "cancelled" and last["completion_tokens"] < 80, last


def test_the_queue_limit_under_concurrent_clients(fp16_model, monkeypatch):
    """Deterministic: the first generation is held until the second waits in the queue of one and the third and fourth
    were refused; then it runs. Exactly two answers and two 429s with Retry-After, whatever the timing."""
    release, started = threading.Event(), threading.Event()
    real = fp16_model.generate_tokens  # what the server calls

    def held(*args, **kwargs):
        if not started.is_set():
            started.set()
            assert release.wait(120), "the test never released the first generation"
        return real(*args, **kwargs)

    monkeypatch.setattr(fp16_model, "generate_tokens", held)
    with running(fp16_model, queue_size=1) as url:
        c = client(url)

        def ask(i: int):
            try:
                r = c.chat.completions.with_raw_response.create(model="demo", messages=MESSAGES, max_tokens=4, temperature=0)
                return "ok", r.parse().usage.completion_tokens
            except openai.RateLimitError as e:
                return "429", e.response.headers.get("retry-after")

        def busy() -> int:
            return httpx.get(f"{url}/health").json()["busy"]

        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(ask, 0)
            assert started.wait(60), "the first request never reached the model"
            second = pool.submit(ask, 1)
            deadline = time.monotonic() + 60
            while busy() < 2:  # the second waits behind the held first
                assert time.monotonic() < deadline and not second.done(), second
                time.sleep(0.05)
            refused = [ask(2), ask(3)]  # the running one and the queue of one take every slot
            release.set()
            results = [first.result(timeout=120), second.result(timeout=120)]
    assert [k for k, _ in results] == ["ok", "ok"] and all(n >= 1 for _, n in results), results
    assert [k for k, _ in refused] == ["429", "429"] and all(int(v) >= 1 for _, v in refused), refused


def test_the_api_key(fp16_model):
    with running(fp16_model, api_key="s3cret") as url:
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, "wrong").models.list()
        assert e.value.code == "invalid_api_key"
        assert httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "x"}).status_code == 401
        assert client(url, "s3cret").chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2).choices
        assert httpx.get(f"{url}/health").status_code == 200  # the health check needs no key


def test_serve_command_stops_cleanly_on_sigterm(fp16_export):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimum_qnn", "serve", str(fp16_export.output), "--port", str(port), "--name", "demo",
         "--shutdown-grace", "0"],
        cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "serve did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        reply = client(f"http://127.0.0.1:{port}").chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3)
        assert reply.choices[0].message.content is not None
        # SIGTERM while a stream runs, with no grace period: the generation is cancelled at its next token and the
        # stream ends whole, with an error event that says why; the server exits 0.
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": "demo", "prompt": "for", "max_tokens": 40, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line]  # a connection cut mid-stream raises here
        last = events[-1]
        assert '"code": "server_shutdown"' in last and "The server is stopping" in last, events[-3:]
        assert len(events) < 40  # cut short: 40 tokens were asked for
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert out.splitlines()[0].startswith("Serving 'demo' (SM8650") and "Server stopped (SIGTERM)." in out
    assert "[INFO]" not in out + err and "Traceback" not in err
