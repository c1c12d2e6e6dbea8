"""The runtime's one-place rules, on plain ints and a byte-level stand-in tokenizer: `limits.Limits` (prompt limit and
room per backend kind), `text_stream.TextStream` (never a half character out), `stops` (a conversation's stop ids).
These modules import neither torch nor transformers; a child interpreter checks that."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest

from optimum_qnn.errors import ContextOverflowError
from optimum_qnn.runtime.limits import DEFAULT_MAX_NEW_TOKENS, Limits
from optimum_qnn.runtime.stops import conversation_stop_ids, text_stop_ids
from optimum_qnn.runtime.text_stream import PrintingStreamer, TextStream
from tests.conftest import REPO_ROOT, child_env


def _contract(context_len: int, *ars: tuple[str, int]):
    return SimpleNamespace(context_len=context_len, methods=[SimpleNamespace(name=n, ar_len=a) for n, a in ars])


HYBRID = _contract(96, ("prefill_forward", 16), ("kv_forward", 1))
KV = _contract(64, ("kv_forward", 1))


def test_the_prompt_limit_and_room_of_each_backend():
    host, runner, adb = (Limits.of(HYBRID, d) for d in ("host", "runner", "adb:PHONE1"))
    assert (host.max_prompt, runner.max_prompt, adb.max_prompt) == (96, 80, 80)  # the runner prefills into C - AR
    assert Limits.of(KV, "runner").max_prompt == 63  # kv mode: its prompt goes one token at a time
    assert host.room(96) == 1 and host.room(90) == 7  # the host's last token is never fed back
    assert runner.room(80) == 16 and runner.room(81) == 0  # up to --seq_len = C
    assert host.default_max_new_tokens(10) == 87 and Limits.of(_contract(1024, ("kv_forward", 1)), "host").default_max_new_tokens(10) == DEFAULT_MAX_NEW_TOKENS
    with pytest.raises(ContextOverflowError, match=r"81 tokens .*holds 96 .*at most 80 \(ExecuTorch's runner"):
        runner.check_prompt(81)
    host.check_prompt(96)
    lookahead = _contract(256, ("prefill_forward", 32), ("kv_forward", 32))  # ExecuTorch stops past C - AR
    assert Limits.of(lookahead, "runner").room(200) == 25 and Limits.of(lookahead, "host").room(200) == 26
    with pytest.raises(ValueError, match="Unknown backend kind 'ort'; expected one of: host, runner, adb"):
        Limits.of(HYBRID, "ort")


class _Bytes:
    """A byte-level tokenizer: each id is one byte; decoding an incomplete UTF-8 sequence gives U+FFFD."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def get_vocab(self):
        return {"<eos>": 1, "<turn|>": 106}


def test_the_text_stream_never_gives_half_a_character():
    stream = TextStream(_Bytes())
    given = []
    for token in "né".encode():
        stream.add([token])
        given.append(stream.take_stable())
    assert given == ["n", "", "é"] and stream.text == "né"
    stream.add([0xE2])  # the first byte of a three-byte character, and the generation ends
    assert stream.take_stable() == "" and stream.finish() == "\ufffd"
    out = io.StringIO()
    printer = PrintingStreamer(_Bytes(), out)
    for token in "é!".encode():
        printer.put(SimpleNamespace(reshape=lambda *_, t=token: SimpleNamespace(tolist=lambda: [t])))
    printer.end()
    assert out.getvalue() == "é!\n"


def test_a_conversation_stops_at_the_turn_end_and_plain_text_at_eos():
    assert conversation_stop_ids([1], _Bytes()) == [1, 106]
    assert text_stop_ids([1], _Bytes(), chat=True) == [1, 106] and text_stop_ids([1], _Bytes(), chat=False) == [1]


def test_the_rule_modules_import_neither_torch_nor_transformers():
    code = ("import sys\nimport optimum_qnn.runtime.limits, optimum_qnn.runtime.stops, optimum_qnn.runtime.text_stream\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
