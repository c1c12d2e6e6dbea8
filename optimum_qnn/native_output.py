"""Keep what the QNN compiler's C++ libraries print off the terminal, and show it when lowering fails (split from
lowering.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator


class _NativeLog:
    text: str = ""


@contextlib.contextmanager
def quiet_native_output() -> Iterator[_NativeLog]:
    """Collect what the QNN compiler prints (per-op INFO lines, progress bars written straight to the process's
    stdout/stderr by the C++ libraries) instead of flooding the terminal; re-emit it if lowering fails.

    Python loggers of executorch are held at WARNING meanwhile (it configures INFO logging of every partitioned op).
    """
    log = _NativeLog()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    root = logging.getLogger()
    level = root.level
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        root.setLevel(max(level, logging.WARNING))
        try:
            yield log
        except BaseException:
            _restore(saved)
            sink.seek(0)
            sys.stderr.write(sink.read()[-20000:].decode(errors="replace"))
            raise
        finally:
            root.setLevel(level)
            _restore(saved)
            os.close(saved[0])
            os.close(saved[1])
        sink.seek(0)
        log.text = sink.read().decode(errors="replace")


def _restore(saved: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
