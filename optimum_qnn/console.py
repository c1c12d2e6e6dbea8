"""What the commands show on the console, and what they hold back: one control, ``-v``, for `export`, `run`,
`doctor`, `inspect` and the demo (split from cli.py).

Without ``-v`` a command shows this project's records (warnings, one line per finished stage, progress) and its
own output; what the libraries under it print (Python warnings, their loggers' notices, what their C++ code writes
to the process's stdout/stderr, the QNN runtime's `[INFO] [Qnn ExecuTorch]` lines) is held back. With ``-v``
everything goes through, and the project logs every stage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.native_output import NATIVE_LOGGER, flush_output


class _ConsoleFilter(logging.Filter):
    """Without -v the console shows this project's records (warnings, and one line per finished stage) and only
    errors of the libraries under it: their deprecation notices and load-time warnings are not the user's to fix."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("optimum_qnn") or record.levelno >= logging.ERROR


class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.name == "optimum_qnn.stages":
            return record.getMessage()
        return f"{record.levelname} {record.name}: {record.getMessage()}" + (
            "\n" + self.formatException(record.exc_info) if record.exc_info else ""
        )


# What ``-v`` means on every command (`configure_logging` and `third_party_quiet` both take it); a command that shows
# more with it says so after this text.
VERBOSE_HELP = ("log what optimum-qnn does step by step and show what the libraries print (the QNN runtime's own "
                "log lines, their warnings)")


def configure_logging(verbose: bool) -> None:
    """The console handler on the root logger (replacing one this function added before). ``verbose`` logs every
    stage and lets the QNN libraries print their own lines (`optimum_qnn.native_output.NATIVE_LOGGER`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ConsoleFormatter())
    if not verbose:
        handler.addFilter(_ConsoleFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_optimum_qnn", False)]:
        root.removeHandler(old)
    handler._optimum_qnn = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("optimum_qnn.stages").setLevel(logging.INFO)
    logging.getLogger(NATIVE_LOGGER).setLevel(logging.DEBUG if verbose else logging.NOTSET)


# Loggers that print through their own handlers (not the root's), so the console filter never sees them.
# torch.utils._pytree: "register_constant() on Enum subclasses is deprecated", logged when torchao is imported.
_OWN_HANDLER_LOGGERS = ("torch",)


@contextlib.contextmanager
def third_party_quiet(verbose: bool, *, keep_stdout: bool = False) -> Iterator[None]:
    """Hide what the libraries under a command print while it runs, unless ``verbose``.

    - Python warnings (FutureWarning/DeprecationWarning from torch, executorch, torchao) are ignored, except this
      project's own;
    - loggers with their own handlers (torch's) are held at ERROR;
    - the process's stdout and stderr, at the file-descriptor level, go to a temporary file: ExecuTorch's quantizer
      `print`s "No quant config is implemented for op ...", the QNN libraries print from C++ ("# LIBNATIVE: ...",
      and the runtime's "[INFO] [Qnn ExecuTorch]: ..." lines when a .pte is loaded). Python's ``sys.stderr`` (the
      console log handler, progress bars) is pointed at a copy of the real stderr meanwhile, so the project's own
      output still shows; with ``keep_stdout``, ``sys.stdout`` too (a command that prints as it goes: `run`'s
      streamed text, `doctor`'s report), which lets Python-level prints of the libraries through as well. If the
      block fails with anything but this project's errors, the captured tail is echoed for the bug report.
    """
    if verbose:
        yield
        return
    import gc
    import tempfile
    import warnings

    try:
        import torch  # noqa: F401  (torch configures its loggers on import; hold them after that)
    except ImportError:  # the runtime install has no torch: no logger of its to hold
        pass

    levels = {name: logging.getLogger(name).level for name in _OWN_HANDLER_LOGGERS}
    flush_output()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(2), "w", buffering=1)
    # A sys.stdout that is not file descriptor 1 (a redirect_stdout, pytest's capsys) is not redirected: left as it is.
    terminal_out = os.fdopen(os.dup(1), "w", buffering=1) if keep_stdout and _writes_to(sys.stdout, 1) else None
    python_stdout, python_stderr = sys.stdout, sys.stderr
    handlers = [h for h in logging.getLogger().handlers if getattr(h, "stream", None) is python_stderr]
    with tempfile.TemporaryFile(mode="w+b") as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("default", module=r"optimum_qnn(\.|$)")
        for name in levels:
            logging.getLogger(name).setLevel(logging.ERROR)
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        sys.stderr = console
        if terminal_out is not None:
            sys.stdout = terminal_out
        for handler in handlers:
            handler.setStream(console)
        try:
            yield
        except (OptimumQnnError, KeyboardInterrupt):
            raise
        except BaseException:
            flush_output()
            sink.seek(0)
            tail = sink.read()[-5000:].decode(errors="replace")
            if tail.strip():
                console.write(f"(output of the libraries before the failure:)\n{tail}\n")
            raise
        finally:
            gc.collect()  # what the libraries print when their objects are freed (QNN contexts) goes to the sink too
            flush_output()
            console.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sys.stdout, sys.stderr = python_stdout, python_stderr
            for handler in handlers:
                handler.setStream(python_stderr)
            console.close()
            if terminal_out is not None:
                terminal_out.close()
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _writes_to(stream, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: no file descriptor
        return False
