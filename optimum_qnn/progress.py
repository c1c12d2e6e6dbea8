"""Progress of the export's long stages, as a terminal shows it or as a log file keeps it (split from export.py).

In a terminal (stderr is a tty) bars redraw in place: tqdm's over calibration samples, sensitivity probes and
evaluation windows, and the lowering's line, which names the step that runs (ExecuTorch's own passes run for
minutes before the first shard compiles at Gemma-4-E2B's size: 12 on a slow 2-core machine) and counts the shards
compiled, its elapsed time and RSS ticking every second.

When stderr is a file or a pipe (CI, ``nohup``, a job scheduler) nothing redraws: the per-item bars are off (each
stage ends with its own line, with wall time and peak RSS: `optimum_qnn.exporter.pipeline`) and the lowering writes one line
per step and per compiled shard, each with elapsed time and RSS. Redrawn once a second into a log, the lowering bar
alone wrote over 1,000 lines for a full-size Gemma-4-E2B export.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO

# The records the lowering's progress reads (INFO): the lowering's steps (`report_step`, on this logger), and the
# shards that the compile workers prepare and finish, as (shard, shards), on optimum_qnn.exporter.parallel_compile's logger.
progress_logger = logging.getLogger("optimum_qnn.progress")
_PROGRESS_LOGGERS = (progress_logger.name, "optimum_qnn.exporter.parallel_compile")
STEP_MESSAGE = "Lowering step: %s"
PREPARING_MESSAGE = "Preparing shard %d/%d"
COMPILED_MESSAGE = "Compiled shard %d/%d"
# Without workers, ExecuTorch's QnnBackend compiles the shards one after the other and logs "Processing Method(j):
# (i/N)" as it builds each method's i-th partition (executorch 1.5.1 backends/qualcomm/qnn_preprocess.py).
QNN_PREPROCESS_LOGGER = "executorch.backends.qualcomm.qnn_preprocess"


def report_step(what: str) -> None:
    """Say which step of the lowering starts, e.g. ``"converting to the edge dialect"``."""
    progress_logger.info(STEP_MESSAGE, what)


def bar(iterable: Iterable, desc: str, unit: str, *, enabled: bool = True) -> Iterable:
    """``iterable`` with a tqdm bar on stderr when it is a terminal; as it is otherwise (or when not ``enabled``)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, unit=unit, disable=None if enabled else True)  # None: off unless a tty


class _ToProgress(logging.Filter):
    """On a progress logger: its progress records go to ``progress`` only (a display, not the console handlers
    above, which show every optimum_qnn record); the others go on as before the display lowered the logger's level
    to INFO, e.g. the compile gate's decisions (`parallel_compile`) with ``-v``."""

    def __init__(self, progress: LoweringProgress | None, level: int) -> None:
        super().__init__()
        self.progress, self.level = progress, level

    def filter(self, record: logging.LogRecord) -> bool:
        if self.progress is not None and record.levelno >= logging.INFO and self.progress.take(record):
            return False
        return record.levelno >= self.level


@contextlib.contextmanager
def progress_lines_to(progress: LoweringProgress) -> Iterator[None]:
    """Within the block, the progress records of the progress loggers (INFO) go to ``progress`` only; their other
    records reach the handlers above as they did before the block."""
    loggers = [logging.getLogger(name) for name in _PROGRESS_LOGGERS]
    saved = [source.level for source in loggers]
    filters = [_ToProgress(progress, source.getEffectiveLevel()) for source in loggers]
    for source, divert in zip(loggers, filters):
        source.addFilter(divert)
        source.setLevel(min(source.getEffectiveLevel(), logging.INFO))
    try:
        yield
    finally:
        for source, level, divert in zip(loggers, saved, filters):
            source.removeFilter(divert)
            source.setLevel(level)


@contextlib.contextmanager
def relayed_progress_loggers(pipe) -> Iterator[None]:
    """In a forked child (`optimum_qnn.exporter.forked`): the progress records go down ``pipe`` to the parent, whose
    display shows them, instead of to the display the child inherited (whose redrawing thread did not survive the
    fork)."""
    import pickle

    class _PipeHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                pipe.write(pickle.dumps((record.name, record.levelno, record.getMessage())))
            except (OSError, ValueError):  # the parent stopped reading: progress is not worth failing for
                pass

    relay = _PipeHandler()  # every record the loggers make: the parent's loggers decide what shows
    loggers = [logging.getLogger(name) for name in (*_PROGRESS_LOGGERS, QNN_PREPROCESS_LOGGER)]
    removed, propagate = [], [source.propagate for source in loggers]
    for source in loggers:
        source.propagate = False  # the parent shows them (or drops them) as its own records
        for handler in [h for h in source.handlers if isinstance(h, LoweringProgress)]:
            source.removeHandler(handler)
            removed.append((source, handler))
        for divert in [f for f in source.filters if isinstance(f, _ToProgress)]:  # the parent's display
            source.removeFilter(divert)
            removed.append((source, divert))
        source.addHandler(relay)
    try:
        yield
    finally:
        for source, flag in zip(loggers, propagate):
            source.removeHandler(relay)
            source.propagate = flag
        for source, taken in removed:
            (source.addFilter if isinstance(taken, _ToProgress) else source.addHandler)(taken)


class LoweringProgress(logging.Handler):
    """Where a lowering is, read from the records above: the step that runs, what happens to a shard (prepared,
    compiled), and how many shards of how many are done. Each change goes to ``view`` (`update(self)`)."""

    _STEP = re.compile(re.escape(STEP_MESSAGE).replace("%s", "(.+)"))
    _PREPARING, _COMPILED = (re.compile(m.replace("%d", r"(\d+)")) for m in (PREPARING_MESSAGE, COMPILED_MESSAGE))
    _PROCESSING = re.compile(r"Processing Method\((\d+)\): \((\d+)/(\d+)\)")

    def __init__(self, desc: str, view=None) -> None:
        super().__init__(logging.INFO)
        self.desc, self.view = desc, view
        self.step = ""  # e.g. "partitioning kv_forward"
        self.activity = ""  # e.g. "compiling shard 2 (method 1)"
        self.n, self.total = 0, None

    def emit(self, record: logging.LogRecord) -> None:
        self.take(record)

    def take(self, record: logging.LogRecord) -> bool:
        """Show ``record`` if it says where the lowering is; whether it did."""
        message = record.getMessage()
        if step := self._STEP.fullmatch(message):
            if self.total:  # a step after the shards: they are all compiled
                self.n = self.total
            self.step, self.activity = step.group(1), ""
        elif not self._shard_record(message):
            return False
        self._show()
        return True

    def _shard_record(self, message: str) -> bool:
        if compiled := self._COMPILED.fullmatch(message):
            self.n, self.total = map(int, compiled.groups())
            if self.n == self.total:
                self.activity = ""
        elif preparing := self._PREPARING.fullmatch(message):
            shard, self.total = map(int, preparing.groups())
            self.activity = f"preparing shard {shard}"
        elif processing := self._PROCESSING.search(message):
            method, shard, self.total = map(int, processing.groups())
            self.n = shard - 1  # shards finished
            self.activity = f"compiling shard {shard} (method {method + 1})"
        else:
            return False
        self.step = ""  # compiling the shards is the step now
        return True

    def key(self) -> tuple:
        """What a log view writes a new line for: the step and the shards done."""
        return self.step, self.n, self.total

    def finish(self) -> None:
        """The lowering returned: every shard is done."""
        if self.total:
            self.n = self.total
        self.step, self.activity = ("" if self.total else "done"), ""
        self._show()

    def line(self) -> str:
        """E.g. ``Lowering for SM8650: converting to the edge dialect`` or ``...: 1/7 shards done, preparing shard 3``."""
        parts = [f"{self.n}/{self.total} shards done"] if self.total else []
        if self.activity or self.step:
            parts.append(self.activity or self.step)
        return f"{self.desc}: {', '.join(parts)}" if parts else self.desc

    def _show(self) -> None:
        if self.view is not None:
            self.view.update(self)


class _TerminalView:
    """The lowering's line, redrawn in place; elapsed time and RSS tick every second."""

    def __init__(self, stream: TextIO, desc: str, rss_mb: Callable[[], float] | None) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(desc=desc, total=None, file=stream, mininterval=1.0, bar_format="{desc} [{elapsed}{postfix}]")
        self._done = threading.Event()

        def tick() -> None:
            while not self._done.wait(1.0):
                self.bar.set_postfix_str(f"RSS {rss_mb() / 1024:.1f} GB" if rss_mb else "")

        self._ticker = threading.Thread(target=tick, daemon=True)
        self._ticker.start()

    def update(self, progress: LoweringProgress) -> None:
        self.bar.set_description_str(progress.line())

    def close(self) -> None:
        self._done.set()
        self._ticker.join()
        self.bar.close()


class _LogView:
    """One line per step and per change of the shards done (not per method or worker within a shard), each with
    elapsed time and RSS."""

    def __init__(self, stream: TextIO, rss_mb: Callable[[], float] | None) -> None:
        self.stream, self.rss_mb = stream, rss_mb
        self.t0 = time.monotonic()
        self.last: tuple | None = None

    def update(self, progress: LoweringProgress) -> None:
        key = progress.key()
        if key == self.last:
            return
        self.last = key
        from tqdm import tqdm

        stats = tqdm.format_interval(time.monotonic() - self.t0)
        if self.rss_mb:
            stats += f", RSS {self.rss_mb() / 1024:.1f} GB"
        self.stream.write(f"{progress.line()} [{stats}]\n")
        self.stream.flush()

    def close(self) -> None:
        pass


@contextlib.contextmanager
def lowering_progress(desc: str, rss_mb: Callable[[], float] | None = None) -> Iterator[LoweringProgress | None]:
    """Show a lowering's progress on stderr while the block runs: a line redrawn in a terminal, one line per step
    and shard in a log file (see the module's docstring). ``rss_mb`` gives the memory shown beside it.

    It writes to its own copy of stderr's file: the lowering points the process's stdout/stderr at a log file
    meanwhile (see `optimum_qnn.native_output.quiet_native_output`)."""
    try:
        stream = os.fdopen(os.dup(sys.stderr.fileno()), "w")  # the file sys.stderr writes to, not always fd 2
    except (OSError, ValueError):  # a stderr without a file descriptor (captured, e.g. by pytest): no display
        yield None
        return
    view = _TerminalView(stream, desc, rss_mb) if stream.isatty() else _LogView(stream, rss_mb)
    progress = LoweringProgress(desc, view)
    preprocess = logging.getLogger(QNN_PREPROCESS_LOGGER)
    preprocess.addHandler(progress)
    try:
        with progress_lines_to(progress):
            yield progress
        progress.finish()
    finally:
        preprocess.removeHandler(progress)
        view.close()
        stream.close()


class _SideBySide:
    """Several lowerings on one line, e.g. ``Lowering for SM8550: 1/2 shards done | SM8650: partitioning kv_forward``:
    one `LoweringProgress` per lowering (its records come from the forked child that runs it), one view for all.
    Each child's records arrive on its own relay thread: the view is updated under a lock, so two children's
    records never interleave a line or both write the same one."""

    def __init__(self, descs: list[str], view) -> None:
        self.view = view
        self.parts = [LoweringProgress(desc, self) for desc in descs]
        self._lock = threading.Lock()

    def update(self, _part: LoweringProgress) -> None:
        if self.view is not None:
            with self._lock:
                self.view.update(self)

    def key(self) -> tuple:
        return tuple(part.key() for part in self.parts)

    def line(self) -> str:
        return " | ".join(part.line() for part in self.parts)


@contextlib.contextmanager
def side_by_side_progress(descs: list[str], rss_mb: Callable[[], float] | None = None) -> Iterator[list[LoweringProgress]]:
    """`lowering_progress` for lowerings that run side by side in forked children (one display line for all):
    yields one `LoweringProgress` per lowering, for its child's records (`optimum_qnn.exporter.forked.Forked`'s
    ``records``); `finish()` each as its lowering returns. Without a stderr file descriptor nothing is shown."""
    # The children inherit these loggers' levels: at INFO, their steps reach the pipe (`relayed_progress_loggers`).
    # Here their other records (`forked._relay_records`) show as they would have before the levels were lowered.
    loggers = [logging.getLogger(name) for name in (*_PROGRESS_LOGGERS, QNN_PREPROCESS_LOGGER)]
    levels = [source.level for source in loggers]
    gates = [_ToProgress(None, source.getEffectiveLevel()) for source in loggers]
    for source, gate in zip(loggers, gates):
        source.addFilter(gate)
        source.setLevel(min(source.getEffectiveLevel(), logging.INFO))
    try:
        try:
            stream = os.fdopen(os.dup(sys.stderr.fileno()), "w")
        except (OSError, ValueError):
            yield _SideBySide(descs, None).parts
            return
        view = _TerminalView(stream, " | ".join(descs), rss_mb) if stream.isatty() else _LogView(stream, rss_mb)
        try:
            yield _SideBySide(descs, view).parts
        finally:
            view.close()
            stream.close()
    finally:
        for source, level, gate in zip(loggers, levels, gates):
            source.removeFilter(gate)
            source.setLevel(level)
