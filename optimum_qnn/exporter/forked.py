"""Run one step of the export in a forked child process and hand its result back: a SoC's lowering of a multi-SoC
export (`EdgeLowering.lower(..., keep=True)`, or several side by side: `EdgeLowering.lower_forked`).

Why a child. libQnnHtp numbers the tensors and graphs of every context it builds from process-wide counters (see
`optimum_qnn.exporter.parallel_compile`), so a second lowering in one process makes a different context binary from
the same graphs than the first did. A child forked after the SoC-independent part starts from the counters the
parent has, which no compile advanced: every SoC of a multi-SoC export then gets the program a single-SoC export of
its own gets (measured: they differ only in the 8-byte signature ExecuTorch stamps into each context header from the
clock, `inspection.pte.normalized_program`). And the child changes its copy-on-write copy of the edge programs as it
lowers them, so the parent keeps its own without copying them first.

The child's progress records (the lowering's steps and shards) reach the parent's progress display through a pipe;
its memory (what it does not share with the parent) counts in the export's stage peaks (`parallel_compile._live`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from optimum_qnn.exporter import parallel_compile
from optimum_qnn.progress import LoweringProgress, relayed_progress_loggers

logger = logging.getLogger(__name__)
T = TypeVar("T")


def run_forked(fn: Callable[[], T], what: str, memory_hint: str = "") -> T:
    """``fn()`` in a forked child; its return value (pickled through a file), or its exception raised here.

    Args:
        fn: what the child runs; its result must pickle.
        what: names the work in errors, e.g. "the lowering for SM8650".
        memory_hint: what to do when the kernel killed the child for memory (SIGKILL), e.g. "export fewer SoCs at
            once"; the message then says it.

    Raises:
        whatever ``fn`` raised (when it pickles; a RuntimeError with its traceback otherwise), or RuntimeError when
        the child died (a signal: SIGKILL is what the kernel sends when memory runs out).
    """
    return Forked(fn, what, memory_hint).result()


class Forked(Generic[T]):
    """``fn()`` running in a forked child while this process goes on; `result()` waits for it (see `run_forked`).
    A `Forked` that is never waited for is killed by `cancel()` (or with this process: `die_with_parent`)."""

    def __init__(self, fn: Callable[[], T], what: str, memory_hint: str = "", records: LoweringProgress | None = None):
        self.what, self.memory_hint = what, memory_hint
        self._folder = tempfile.TemporaryDirectory(prefix="optimum-qnn-fork-")
        self._result_path = Path(self._folder.name) / "result.pickle"
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            parallel_compile.freeze_inherited()
            parallel_compile.die_with_parent(parent)
            os.close(read_fd)
            _child(fn, self._result_path, write_fd)
        os.close(write_fd)
        self.pid = pid
        self._reaped = False
        parallel_compile._live[pid] = -1  # its private memory counts in the export's RSS figures
        self._relay = threading.Thread(target=_relay_records, args=(read_fd, records), daemon=True)
        self._relay.start()

    def finished(self) -> bool:
        """Whether the child has ended, so that `result()` returns without waiting."""
        return self._reaped or parallel_compile.exited(self.pid)  # reaped by `result()`

    def cancel(self) -> None:
        """Kill the child (if it still runs) and let go of its files."""
        if not self._reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self._reaped = True
        self._done()

    def _done(self) -> None:
        parallel_compile._live.pop(self.pid, None)
        parallel_compile._private_cache.pop(self.pid, None)
        self._relay.join(timeout=5)
        self._folder.cleanup()

    def result(self) -> T:
        """Wait for the child; its return value, or its exception raised here."""
        what = self.what
        try:
            _, status = os.waitpid(self.pid, 0)
            self._reaped = True
        except BaseException:
            self.cancel()
            raise
        try:
            if os.WIFSIGNALED(status):
                number = os.WTERMSIG(status)
                raise RuntimeError(
                    f"{what[0].upper()}{what[1:]} was killed by signal {signal.Signals(number).name} in its process "
                    f"{self.pid}" + (" (the kernel kills with SIGKILL when memory runs out" +
                                     (f": {self.memory_hint})" if self.memory_hint else ")")
                                     if number == signal.SIGKILL else "")
                )
            if not self._result_path.exists():
                raise RuntimeError(f"{what[0].upper()}{what[1:]} ended (exit code {os.WEXITSTATUS(status)}) without a result")
            with self._result_path.open("rb") as f:
                ok, value = pickle.load(f)
        finally:
            self._done()
        if ok:
            return value
        raise value


def _child(fn: Callable[[], object], result_path: Path, write_fd: int) -> None:
    """The child's whole life: run, write the result (or the error), leave without Python's shutdown."""
    code = 1
    try:
        import torch

        # The parent's OpenMP threads do not exist here; one thread keeps torch off that pool.
        torch.set_num_threads(1)
        with os.fdopen(write_fd, "wb", buffering=0) as pipe, relayed_progress_loggers(pipe):
            try:
                outcome = (True, fn())
            except BaseException as error:  # noqa: BLE001 - everything goes to the parent, which raises it
                outcome = (False, _picklable(error))
            with result_path.open("wb") as f:
                pickle.dump(outcome, f, protocol=pickle.HIGHEST_PROTOCOL)
        code = 0
    except BaseException:  # noqa: BLE001
        with contextlib.suppress(BaseException):
            sys.__stderr__.write(traceback.format_exc())
    finally:
        os._exit(code)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - an error that does not pickle travels as its traceback
        return RuntimeError("".join(traceback.format_exception(error)))


def _relay_records(read_fd: int, records: LoweringProgress | None = None) -> None:
    """Hand the child's progress records to ``records`` (one lowering's display among several side by side), and
    the others (or all, without ``records``) to this process's loggers (and so to its progress display)."""
    with os.fdopen(read_fd, "rb") as pipe:
        while True:
            try:
                name, level, message = pickle.load(pipe)
            except (EOFError, pickle.UnpicklingError, OSError):
                return
            record = logging.makeLogRecord(
                {"name": name, "levelno": level, "levelname": logging.getLevelName(level), "msg": message}
            )
            if records is not None and records.take(record):  # a progress record of this lowering's display
                continue
            source = logging.getLogger(name)
            if source.isEnabledFor(level):
                source.handle(record)  # through its filters (a display's, a level gate)
