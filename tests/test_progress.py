"""The lowering's progress as a log file keeps it (a line per step and per shard) and as a terminal shows it (the step
that runs, redrawn in place), fed the records a sharded lowering logs; no lowering runs here."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import select
import struct
import sys
import termios
from typing import TextIO

import pytest

from optimum_qnn.progress import (
    COMPILED_MESSAGE,
    PREPARING_MESSAGE,
    QNN_PREPROCESS_LOGGER,
    bar,
    lowering_progress,
    report_step,
)

# The compile workers log their shards here (optimum_qnn.exporter.parallel_compile).
WORKERS = logging.getLogger("optimum_qnn.exporter.parallel_compile")


def _terminal() -> tuple[int, TextIO]:
    """A pseudo-terminal of 120 columns: (its master fd, to read what was drawn; a stream on its slave side)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    return master, os.fdopen(slave, "w")


def _drain(master: int) -> str:
    """Everything drawn on the terminal so far (one read may return only part of it)."""
    chunks = []
    while select.select([master], [], [], 0.5)[0]:
        chunks.append(os.read(master, 65536))
    return b"".join(chunks).decode()


def _lowering_records(shards: int = 3) -> None:
    """What a two-method lowering in ``shards`` shards logs: its steps, the workers' shards (last one first, as
    `parallel_compile.compile_order` does), then ExecuTorch's per-method lines of a sequential compile."""
    report_step("re-exporting the graphs")
    for method in ("prefill_forward", "kv_forward"):
        report_step(f"converting {method} to the edge dialect")
        for _ in range(50):  # the records of ExecuTorch's own passes, which are not progress
            logging.getLogger("executorch.exir").info("a pass ran")
    for shard in [shards, *range(1, shards)]:
        WORKERS.info(PREPARING_MESSAGE, shard, shards)
    for done in range(1, shards + 1):
        WORKERS.info(COMPILED_MESSAGE, done, shards)
    report_step("serializing the program")


def test_log_file_gets_a_line_per_step_and_shard(tmp_path, monkeypatch):
    log = (tmp_path / "stderr.log").open("w+")
    monkeypatch.setattr(sys, "stderr", log)
    with lowering_progress("Lowering for SM8650", rss_mb=lambda: 2048.0):
        _lowering_records(shards=3)
    log.seek(0)
    text = log.read()
    assert "\r" not in text  # nothing is redrawn
    lines = text.splitlines()
    # 4 steps, the first shard record (preparing), 3 compiled shards, the end: not one line per record or per second.
    assert len(lines) == 4 + 1 + 3 + 1, text
    assert all(re.fullmatch(r"Lowering for SM8650: .+ \[\d\d:\d\d, RSS 2\.0 GB\]", line) for line in lines), text
    assert lines[1].startswith("Lowering for SM8650: converting prefill_forward to the edge dialect [")
    assert lines[3].startswith("Lowering for SM8650: 0/3 shards done, preparing shard 3 [")
    assert lines[-2].startswith("Lowering for SM8650: 3/3 shards done, serializing the program [")
    assert lines[-1].startswith("Lowering for SM8650: 3/3 shards done [")


def test_sequential_compile_counts_shards_from_executorch_lines(tmp_path, monkeypatch):
    """Without workers the shards are counted from ExecuTorch's "Processing Method(j): (i/N)" lines: one log line
    per shard, not per method within it."""
    log = (tmp_path / "stderr.log").open("w+")
    monkeypatch.setattr(sys, "stderr", log)
    preprocess = logging.getLogger(QNN_PREPROCESS_LOGGER)
    monkeypatch.setattr(preprocess, "level", logging.DEBUG)  # what executorch sets when it is imported
    with lowering_progress("Lowering for SM8650"):
        for shard in (1, 2):
            for method in (0, 1):
                preprocess.info(f"Processing Method({method}): ({shard}/2)")
    log.seek(0)
    assert [line.split(" [")[0] for line in log.read().splitlines()] == [
        "Lowering for SM8650: 0/2 shards done, compiling shard 1 (method 1)",
        "Lowering for SM8650: 1/2 shards done, compiling shard 2 (method 1)",
        "Lowering for SM8650: 2/2 shards done",
    ]


def test_terminal_shows_the_running_step_not_an_unknown_count(monkeypatch):
    """In a terminal the line names the step before any shard compiles (the first minutes of a big lowering), where
    it used to show "0/? shards done"."""
    master, terminal = _terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    try:
        with lowering_progress("Lowering for SM8650"):
            report_step("converting prefill_forward to the edge dialect")
            WORKERS.info(PREPARING_MESSAGE, 2, 2)
        shown = b""
        while select.select([master], [], [], 0.2)[0]:
            shown += os.read(master, 65536)
    finally:
        terminal.close()
        os.close(master)
    screen = shown.decode()
    assert "Lowering for SM8650: converting prefill_forward to the edge dialect [" in screen, screen
    assert "Lowering for SM8650: 0/2 shards done, preparing shard 2 [" in screen
    assert "Lowering for SM8650: 2/2 shards done [" in screen
    assert "?" not in screen and "\r" in screen  # redrawn in place, never an unknown total


@pytest.mark.parametrize("tty", [False, True])
def test_item_bars_only_in_a_terminal(tmp_path, monkeypatch, tty):
    master = None
    if tty:
        master, stream = _terminal()
    else:
        stream = (tmp_path / "stderr.log").open("w+")
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        assert list(bar(range(3), "Calibrating", "sample")) == [0, 1, 2]
        assert list(bar(range(3), "Calibrating", "sample", enabled=False)) == [0, 1, 2]
        stream.flush()
        if tty:
            shown = _drain(master)
            assert "Calibrating" in shown and shown.count("Calibrating") >= 2, shown  # the enabled bar drew, redrew
        else:
            stream.seek(0)
            assert stream.read() == ""
    finally:
        stream.close()
        if master is not None:
            os.close(master)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


GATE = "Waiting for a compile to finish: about 9000 MiB needed"  # an INFO record of the compile gate, not progress


@pytest.mark.parametrize("verbose", [False, True])
def test_the_display_takes_progress_records_and_passes_the_others_on(tmp_path, monkeypatch, verbose):
    """During a lowering the progress records go to its display only; the compile gate's other records (on the same
    logger) reach the console with -v (the root logger at INFO), and stay hidden without it, as outside a lowering."""
    log = (tmp_path / "stderr.log").open("w+")
    monkeypatch.setattr(sys, "stderr", log)
    root, kept = logging.getLogger(), _Kept()
    monkeypatch.setattr(root, "level", logging.INFO if verbose else logging.WARNING)
    root.addHandler(kept)
    try:
        with lowering_progress("Lowering for SM8650"):
            WORKERS.info(PREPARING_MESSAGE, 2, 2)
            WORKERS.info(GATE)
            WORKERS.info(COMPILED_MESSAGE, 1, 2)
        WORKERS.info(GATE)  # outside the lowering: the same
    finally:
        root.removeHandler(kept)
    assert kept.messages == ([GATE, GATE] if verbose else [])
    log.seek(0)
    assert "1/2 shards done" in log.read()


@pytest.mark.parametrize("verbose", [False, True])
def test_a_side_by_side_lowering_relays_progress_to_its_part_and_the_rest_to_the_loggers(monkeypatch, verbose):
    """What a forked lowering sends its parent (`forked._relay_records`): its progress records to its part of the
    side-by-side display, its other records to the parent's loggers at the level they had before the display."""
    import pickle

    from optimum_qnn.exporter.forked import _relay_records
    from optimum_qnn.progress import side_by_side_progress

    root, kept = logging.getLogger(), _Kept()
    monkeypatch.setattr(root, "level", logging.INFO if verbose else logging.WARNING)
    root.addHandler(kept)
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as pipe:
        for message in (PREPARING_MESSAGE % (1, 2), GATE, COMPILED_MESSAGE % (1, 2)):
            pickle.dump((WORKERS.name, logging.INFO, message), pipe)
        pickle.dump((WORKERS.name, logging.DEBUG, "Shard 1/2: compiling in worker 7"), pipe)
    try:
        with side_by_side_progress(["SM8550", "SM8650"]) as parts:
            _relay_records(read_fd, parts[1])
    finally:
        root.removeHandler(kept)
    assert parts[1].line() == "SM8650: 1/2 shards done, preparing shard 1" and parts[0].line() == "SM8550"
    assert kept.messages == ([GATE] if verbose else [])
