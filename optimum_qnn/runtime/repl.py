"""`python -m optimum_qnn chat`: a conversation in the terminal, the reply printed as it is generated.

``/reset`` starts over (the system prompt stays), ``/exit`` or Ctrl-D quits, Ctrl-C during a reply stops it and keeps
the conversation (on the host backend at the next token; a runner process is stopped and its reply dropped). On an
image variant, ``/image PATH`` adds an image to the next message (``chat --image PATH`` to the first).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from optimum_qnn.runtime.chat import ChatSession
from optimum_qnn.runtime.text_stream import PrintingStreamer

HELP = "/reset starts over, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


IMAGE_HELP = "/image PATH adds an image to the next message"


def run(chat: ChatSession, *, verbose: bool = False, stdin: TextIO | None = None, out: TextIO | None = None,
        images: Sequence[str] = ()) -> int:
    """Read messages until ``/exit`` or end of input; returns the exit status. ``images`` open the first message."""
    stdin = sys.stdin if stdin is None else stdin
    out = sys.stdout if out is None else out  # read now: a command's console control may have replaced it
    model = chat.model
    takes_images = getattr(model, "takes_images", False)
    out.write(f"Chat with {model.name} ({model.manifest.target.soc}, {model.manifest.quantization.scheme}, context "
              f"{model.contract.context_len}) on {model.device_name}. {HELP}"
              + (f", {IMAGE_HELP}" if takes_images else "") + ".\n")
    out.flush()
    pending = list(images)  # the images of the next message
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
            pending = []
            out.write("(the conversation starts over)\n")
            continue
        if text == "/image" or text.startswith("/image "):
            path = text[len("/image"):].strip()
            if not takes_images:
                out.write("This variant takes no images: start the chat with --image on an image variant (export "
                          "--task image-text-to-text).\n")
            elif not path or not Path(path).expanduser().is_file():
                out.write(f"No such image file: {path!r} (/image PATH)\n")
            else:
                pending.append(str(Path(path).expanduser()))
                out.write(f"(image {len(pending)} of the next message: {path})\n")
            continue
        if text.startswith("/"):
            out.write(f"Unknown command {text.split()[0]}: {HELP}" + (f", {IMAGE_HELP}" if takes_images else "") + ".\n")
            continue
        if _reply(chat, text, verbose, out, pending):
            pending = []


def _reply(chat: ChatSession, text: str, verbose: bool, out: TextIO, images: Sequence[str] = ()) -> bool:
    """One turn; returns whether the message (and its images) went into the conversation."""
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
        chat.send(text, streamer=streamer, cancel=lambda: stop["asked"], images=list(images) or None)
    except KeyboardInterrupt:
        out.write("\n(stopped; the reply was dropped)\n")
        return False
    except OptimumQnnError as e:
        out.write(f"error: {e}\n")
        return False
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
    return True
