"""Run a Python module as __main__ and write this process's peak RSS (VmHWM, MB) to a file when it exits.

A child's `ru_maxrss` from `wait4` is not its own peak on Linux: the high-water mark of the parent's memory at
fork/exec time is carried into it. VmHWM of the exec'd process is.

Usage: python benchmarks/peak_rss.py OUT_FILE -m MODULE [ARGS...]
"""

from __future__ import annotations

import atexit
import runpy
import sys


def _write_peak(path: str) -> None:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(path, "w") as out:
        out.write(f"{kb / 1024:.1f}\n")


if __name__ == "__main__":
    out_file, flag, module, *rest = sys.argv[1:]
    assert flag == "-m", __doc__
    atexit.register(_write_peak, out_file)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
