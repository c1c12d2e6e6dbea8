"""The CPU share of an export's stages and lowering steps, measured from /proc while it runs (benchmarks/e2b_full.py).

A stage's CPU share is the CPU seconds of the export's whole process tree (the forked edge conversion, SoC lowerings
and shard compiles included) over its wall seconds: 200 % is both cores of a 2-core machine busy throughout.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

# An export's stage line (optimum_qnn.exporter.pipeline), e.g. "[lower SM8550+SM8650] done in 94.6 s, peak RSS ...".
STAGE_LINE = re.compile(r"\[(?P<name>[\w +]+)\] done in (?P<s>[\d.]+) s, peak RSS (?P<mb>\d+) MB(?: \(anonymous (?P<anon>\d+) MB\))?")


class CpuMeter:
    """Runs until ``proc`` ends: reads its stdout and stderr line by line, stamping each line with the time and the CPU
    seconds its whole process tree had used by then (user + system of every live process under it, plus what the
    ones it reaped used: /proc's utime, stime, cutime and cstime), and samples that CPU figure every half second.
    From them: each stage's CPU share (CPU seconds over wall seconds, 200 % = both cores of two busy) and the
    lowering's steps with theirs; no sampling of stacks, so nothing slows the export."""

    _TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.t0 = proc, time.perf_counter()
        self.samples: list[tuple[float, float]] = []  # (s since start, CPU s)
        self.lines: list[tuple[float, float, str]] = []  # stderr lines: (s, CPU s, text)
        self._lock = threading.Lock()
        out: list[str] = []
        err_reader = threading.Thread(target=self._read_err, daemon=True)
        out_reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
        err_reader.start()
        out_reader.start()
        while proc.poll() is None:
            self._sample()
            time.sleep(0.5)
        err_reader.join()
        out_reader.join()
        self.stdout, self.stderr = "".join(out), "".join(text for _, _, text in self.lines)
        self._points = sorted([*self.samples, *((s, c) for s, c, _ in self.lines)])  # (s, CPU s), every stamp

    def _read_err(self) -> None:
        for text in self.proc.stderr:
            cpu = self._tree_cpu(self.proc.pid)
            with self._lock:
                self.lines.append((time.perf_counter() - self.t0, cpu, text))

    def _sample(self) -> None:
        cpu = self._tree_cpu(self.proc.pid)
        with self._lock:
            self.samples.append((time.perf_counter() - self.t0, cpu))

    @classmethod
    def _tree_cpu(cls, pid: int) -> float:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(child) for child in f.read().split()]
        except (OSError, ValueError, IndexError):  # ended meanwhile: its parent's cutime has it
            return 0.0
        own = sum(int(v) for v in fields[11:15]) / cls._TICK  # utime stime cutime cstime
        return own + sum(cls._tree_cpu(child) for child in children)

    def _cpu_at(self, t: float) -> float:
        """The tree's CPU seconds at ``t`` (linear between the nearest samples and stamped lines)."""
        before = max((p for p in self._points if p[0] <= t), default=(0.0, 0.0))
        after = min((p for p in self._points if p[0] >= t), default=before)
        if after[0] == before[0]:
            return before[1]
        return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])

    def stage_cpu_percent(self, stages: list) -> dict[str, float]:
        """Each stage's CPU share: its line's stamp less its wall seconds is where it began."""
        found = [(t, text) for t, _, text in self.lines if STAGE_LINE.search(text)]
        shares = {}
        for (name, seconds, _), (t, _) in zip(stages, found):
            if seconds >= 1:
                shares[name] = 100 * (self._cpu_at(t) - self._cpu_at(t - seconds)) / seconds
        return shares

    def lowering_steps(self) -> list[tuple[str, float, float]]:
        """The lowering's progress lines (`optimum_qnn.progress`, one per step and shard in a log), each with the wall
        seconds and CPU share from it to the next line."""
        steps = []
        for i, (t, c, text) in enumerate(self.lines):
            if not text.startswith("Lowering"):
                continue
            # to the next progress line, or the stage line that ends the lowering
            t_next, c_next, _ = next((line for line in self.lines[i + 1:]
                                      if line[2].startswith("Lowering") or STAGE_LINE.search(line[2])), self.lines[-1])
            if t_next > t:
                steps.append((re.sub(r" \[.*\]$", "", text.strip()), t_next - t, 100 * (c_next - c) / (t_next - t)))
        return steps
