"""Fit optimum_qnn.exporter.memory's per-stage coefficients to the exports measured in benchmarks/memory_rows.json.

Each row is one export with the per-stage peaks its stage table printed: the anonymous memory (`stages`, what the
estimate is of: the memory the kernel cannot reclaim) and the RSS beside it (`rss`). The demo row gives the two
constants (`_BASE`: its load stage, `_LOWER_BASE`: its lowering); the Gemma-4-E2B-width rows (benchmarks/e2b_width.py
at reduced depth, or the full model from benchmarks/e2b_full.py) and the full Gemma-4-E4B's the coefficients. Per stage, peak - `_BASE` is
fitted by least squares as a x (token table GB, stored) + b x (everything else GB, stored); the lowering as
`_LOWER_BASE` + r x (all weights GB, stored) + s x (parameters of the largest shard). Prints the constants and
coefficients to paste into optimum_qnn/exporter/memory.py and each row's residuals (tests/test_memory.py checks them
against the module).

Usage:
  python benchmarks/memory_fit.py                      fit and print
  python benchmarks/memory_fit.py --add LOG --model e2b-width --depth 7 --reuse 2 --shards 7 --source "..."
                                                       append the row an export's log (its stage table) gives
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from e2b_width import e2b_config, e4b_config  # noqa: E402

from optimum_qnn.exporter.memory import _BASE, _LOWER_BASE, _STAGE_FIT, GB_BYTES  # noqa: E402
from optimum_qnn.exporter.parameters import ParameterCounts  # noqa: E402

ROWS_FILE = Path(__file__).parent / "memory_rows.json"
# the stages memory.py estimates, and among them those fitted per stage (load is the base, lower has its own form)
ESTIMATED_STAGES = tuple(_STAGE_FIT)
FITTED_STAGES = tuple(stage for stage in ESTIMATED_STAGES if stage not in ("load", "lower"))


def counts_of(row: dict) -> ParameterCounts:
    if row["model"] == "demo":
        import tiny_gemma4

        return ParameterCounts.from_config(tiny_gemma4.demo_config())
    if row["model"] == "e4b":
        return ParameterCounts.from_config(e4b_config())
    return ParameterCounts.from_config(e2b_config(row["depth"], row["reuse"]))


def load_rows(*models: str) -> list[dict]:
    """The measured rows of ``models`` (by default the fitted ones: "e2b-width" and "e4b"; or "demo"), each with its
    parameter counts (`counts`) added."""
    models = models or ("e2b-width", "e4b")
    rows = [row for row in json.loads(ROWS_FILE.read_text())["rows"] if row["model"] in models]
    for row in rows:
        row["counts"] = counts_of(row)
    return rows


def fit(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Stage -> its two coefficients (see the module docstring)."""
    coefficients = {}
    for stage in FITTED_STAGES:
        a = np.array([[_table_gb(r), _rest_gb(r)] for r in rows])
        y = np.array([r["stages"][stage] - _BASE for r in rows])
        coefficients[stage] = tuple(float(v) for v in np.linalg.lstsq(a, y, rcond=None)[0])
    a = np.array([[_table_gb(r) + _rest_gb(r), _largest_shard(r) / GB_BYTES] for r in rows])
    y = np.array([r["stages"]["lower"] - _LOWER_BASE for r in rows])
    coefficients["lower"] = tuple(float(v) for v in np.linalg.lstsq(a, y, rcond=None)[0])
    return coefficients


def _table_gb(row: dict) -> float:
    return row["counts"].token_table * row["counts"].stored_bytes / GB_BYTES


def _rest_gb(row: dict) -> float:
    counts = row["counts"]
    return (counts.total - counts.token_table) * counts.stored_bytes / GB_BYTES


def _largest_shard(row: dict) -> int:
    counts = row["counts"]
    return counts.largest_shard(tuple(row["starts"]))


def stage_table(log: str) -> tuple[dict[str, float], dict[str, float]]:
    """(anonymous GB, RSS GB) per stage from the stage table an export prints (`stage wall s peak RSS MB anon MB`);
    a stage named after a SoC (`lower SM8650`) is stored under its first word."""
    anon, rss = {}, {}
    for match in re.finditer(r"^(\w+)(?: SM\w+)?\s+[\d.]+\s+(\d+)\s+(\d+)\s*$", log, re.MULTILINE):
        name, rss_mb, anon_mb = match.group(1), float(match.group(2)), float(match.group(3))
        if name in ESTIMATED_STAGES:  # not the edge and map stages, which the lowering's and quantize's exceed
            anon[name], rss[name] = round(anon_mb / 1024, 3), round(rss_mb / 1024, 3)
    if "lower" not in anon:
        raise SystemExit("no stage table with a lower stage in that log")
    return anon, rss


def add_row(args) -> None:
    anon, rss = stage_table(args.add.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    stored = json.loads(ROWS_FILE.read_text())
    starts = list(counts_of({"model": args.model, "depth": args.depth, "reuse": args.reuse}).shard_starts(args.shards))
    row = {"model": args.model, "depth": args.depth, "reuse": args.reuse, "shards": args.shards, "starts": starts,
           "stages": anon, "rss": rss, "source": args.source, "commit": commit}
    stored["rows"] = [r for r in stored["rows"] if r["source"] != args.source] + [row]
    ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"stored: {row}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--add", type=Path, metavar="LOG", help="an export's log holding its stage table")
    parser.add_argument("--model", choices=("e2b-width", "e4b", "demo"), default="e2b-width")
    parser.add_argument("--depth", type=int)
    parser.add_argument("--reuse", type=int)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--source", help="the command that measured it")
    args = parser.parse_args()
    if args.add:
        add_row(args)
        return 0
    (demo,) = load_rows("demo")
    print(f"_BASE = {demo['stages']['load']:.2f}   _LOWER_BASE = {demo['stages']['lower']:.2f}   (demo row)")
    rows = load_rows()
    coefficients = fit(rows)
    print("stage      coefficient 1   coefficient 2")
    for stage, (a, b) in coefficients.items():
        print(f"{stage:<10} {a:>13.3f}   {b:>13.3f}")
    print("\nresiduals (fit - measured, GB):")
    for row in rows:
        parts = []
        for stage in ESTIMATED_STAGES:
            measured = row["stages"][stage]
            if stage == "load":
                fitted = _BASE
            elif stage == "lower":
                r, s = coefficients["lower"]
                fitted = _LOWER_BASE + r * (_table_gb(row) + _rest_gb(row)) + s * _largest_shard(row) / GB_BYTES
            else:
                a, b = coefficients[stage]
                fitted = _BASE + a * _table_gb(row) + b * _rest_gb(row)
            parts.append(f"{stage} {fitted - measured:+.2f}")
        print(f"  {row['model']}, {len(row['counts'].layers)} layers, {row['shards']} shards: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
