"""`python -m optimum_qnn chat`: a conversation in the terminal, the reply printed as it is generated.

``/reset`` starts over (the system prompt stays), ``/exit`` or Ctrl-D quits, Ctrl-C during a reply stops it and keeps
the conversation (on the host backend at the next token; a runner process is stopped and its reply dropped).
"""

from __future__ import annotations

import signal
import sys
from typing import Any, TextIO

from optimum_qnn.runtime.chat import ChatSession
from optimum_qnn.runtime.text_stream import PrintingStreamer

HELP = "/reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def run(chat: ChatSession, *, verbose: bool = False, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """Read messages until ``/exit`` or end of input; returns the exit status."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out  # read now: a command's console control may have replaced it
    model = chat.model
    out.write(f"Chat with {model.name} ({model.manifest.target.soc}, {model.manifest.quantization.scheme}, context "
              f"{model.contract.context_len}) on {model.device_name}. {HELP}.\n")
    out.flush()
    while True:
        try:
            out.write("> ")
            out.flush()
            line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt
            out.write("\n")
            continue
        if not line:  # Ctrl-D
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            chat.reset()
            out.write("(the conversation starts over)\n")
            continue
        if text.startswith("/"):
            out.write(f"Unknown command {text.split()[0]}: {HELP}.\n")
            continue
        _reply(chat, text, verbose, out)


def _reply(chat: ChatSession, text: str, verbose: bool, out: TextIO) -> None:
    from optimum_qnn.errors import OptimumQnnError

    stop = {"asked": False}
    streamer = PrintingStreamer(chat.tokenizer, out)
    streams = getattr(chat.model.backend, "streams", False)

    def on_sigint(signum, frame):
        stop["asked"] = True
        if not streams:  # a runner process: no token boundary to stop at, so stop the call itself
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        chat.send(text, streamer=streamer, cancel=lambda: stop["asked"])
    except KeyboardInterrupt:
        out.write("\n(stopped; the reply was dropped)\n")
        return
    except OptimumQnnError as e:
        out.write(f"error: {e}\n")
        return
    finally:
        signal.signal(signal.SIGINT, previous)
    s = chat.stats
    if s.stopped_by == "cancelled":
        out.write("(stopped)\n")
    if verbose:
        out.write(
            f"[{s.prompt_tokens} prompt tokens ({s.reused_tokens} reused) + {s.new_tokens} new, stopped by {s.stopped_by}"
            f" | first token {s.time_to_first_token_s:.2f} s | decode {s.decode_tokens_per_s:.1f} tok/s"
            + (f" | dropped {s.dropped_turns} old turn(s)" if s.dropped_turns else "") + "]\n"
        )
    out.flush()
