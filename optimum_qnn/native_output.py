"""Keep what the QNN libraries print from C++ off the terminal: the compiler's output while lowering (shown when
lowering fails), and the runtime's `[INFO] [Qnn ExecuTorch]: ...` lines when a program is loaded and freed.

Why at the file-descriptor level: ExecuTorch 1.5.1's QNN backend prints those lines with `fprintf(stderr, ...)`
whatever the log level (its `Log()` has no level check: a .pte compiled with log level 1, errors only, still prints a
dozen INFO lines per load), and its runtime log-level option (`qnn_runtime_log_level`) cannot be set from Python:
the pybindings take no backend options. So the lines are caught where they are written.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

# The logger whose level shows the QNN libraries' own output: enabled for DEBUG (the commands' -v sets it, as does a
# root logger at DEBUG), what they print goes through untouched; otherwise it is held back.
NATIVE_LOGGER = "optimum_qnn.native"


class _NativeLog:
    text: str = ""


def native_output_shown() -> bool:
    """Whether the QNN libraries' own output goes to the terminal (see `NATIVE_LOGGER`)."""
    return logging.getLogger(NATIVE_LOGGER).isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def quiet_native_output() -> Iterator[_NativeLog]:
    """Collect what the QNN compiler prints (per-op INFO lines, progress bars written straight to the process's
    stdout/stderr by the C++ libraries) instead of flooding the terminal; re-emit it if lowering fails.

    Python loggers of executorch are held at WARNING meanwhile (it configures INFO logging of every partitioned op);
    this project's keep their level, and the console's log handler its terminal.
    """
    root, ours = logging.getLogger(), logging.getLogger("optimum_qnn")
    level, our_level = root.level, ours.level
    ours.setLevel(ours.getEffectiveLevel())  # this project's records keep their level (INFO with -v)
    root.setLevel(max(level, logging.WARNING))
    try:
        with _captured_fds(tail=20000) as log:
            yield log
    finally:
        root.setLevel(level)
        ours.setLevel(our_level)


# What the Python libraries under the runtime log while they are imported, through loggers nobody configured (so
# Python's last-resort handler or torch's own prints them): torchao's "Failed to load .../_C_mxfp8...so" (CUDA
# kernels this CPU build has not) and torch.utils._pytree's "register_constant() on Enum subclasses is deprecated".
_IMPORT_LOGGERS = ("torch", "torchao")
_IMPORT_WARNING_MODULES = r"(torch|torchao|executorch|transformers)(\.|$)"


@contextlib.contextmanager
def quiet_library_logs() -> Iterator[None]:
    """Hold back what torch, torchao, executorch and transformers log and warn while the block runs (a model is
    loaded or generates through the Python API), unless `native_output_shown()`: the API prints nothing unless
    logging asks for it. Their loggers get their levels back after the block; a record at ERROR still shows."""
    if native_output_shown():
        yield
        return
    import warnings

    try:
        import torch  # noqa: F401  (torch sets its loggers up on import: hold them after that)
    except ImportError:  # the runtime install: nothing of torch's to hold
        pass
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=_IMPORT_WARNING_MODULES)
        for logger in loggers:
            logger.setLevel(max(logger.level, logging.ERROR))
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def quietly(fn):
    """``fn`` run inside `quiet_library_logs` (a public entry point of the Python API)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with quiet_library_logs():
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def quiet_runtime() -> Iterator[None]:
    """Hold back what the QNN runtime prints while a program is loaded or freed, unless `native_output_shown()`.
    If the block fails, what was held back is written to stderr: QNN's error lines say why."""
    if native_output_shown():
        yield
        return
    with _captured_fds(tail=5000):
        yield


@contextlib.contextmanager
def _captured_fds(tail: int) -> Iterator[_NativeLog]:
    """Point the process's stdout and stderr (file descriptors 1 and 2) at a temporary file within the block; on a
    failure, write the last ``tail`` bytes of it to the real stderr."""
    log = _NativeLog()
    flush_output()
    saved = os.dup(1), os.dup(2)
    # The log handlers that write to stderr's file descriptor (the console's with -v) keep writing to the real one.
    console = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler) and _fileno(h.stream) == 2]
    real = os.fdopen(os.dup(saved[1]), "w", buffering=1) if console else None
    streams = [h.setStream(real) for h in console]
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield log
        except BaseException:
            _restore(saved)
            sink.seek(0)
            log.text = sink.read().decode(errors="replace")
            sys.stderr.write(log.text[-tail:])
            raise
        finally:
            _restore(saved)
            os.close(saved[0])
            os.close(saved[1])
            for handler, stream in zip(console, streams):
                handler.setStream(stream)
            if real is not None:
                real.close()
        sink.seek(0)
        log.text = sink.read().decode(errors="replace")


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # no file descriptor (a StringIO, pytest's capture)
        return None


def flush_output() -> None:
    """Flush Python's and C's buffered stdout/stderr, so what was written before a redirection lands before it, and
    what was written within it, within it (C's stdout is block-buffered when it is not a terminal)."""
    sys.stdout.flush()
    sys.stderr.flush()
    libc = c_library()
    if libc is not None:
        libc.fflush(None)


@functools.cache
def c_library() -> ctypes.CDLL | None:
    """The C library this process runs on (fflush, madvise, malloc_trim), once looked up; None where there is none."""
    try:
        return ctypes.CDLL(None)  # the C library this process runs on (POSIX)
    except (OSError, TypeError):  # Windows: no process-wide C library handle
        return None


def _restore(saved: tuple[int, int]) -> None:
    flush_output()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
