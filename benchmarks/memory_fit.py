"""Fit optimum_qnn.exporter.memory's per-stage coefficients to the exports measured in benchmarks/memory_rows.json.

Each row is one export of a Gemma-4-E2B-width checkpoint (benchmarks/e2b_width.py at reduced depth, or the full
model from benchmarks/e2b_full.py) with the per-stage peak RSS its stage lines printed. Per stage, peak - `_BASE` is
fitted by least squares as a x (token table GB, stored) + b x (everything else GB, stored); the lowering as
`_LOWER_BASE` + r x (all weights GB, stored) + s x (parameters of the largest shard). Prints the coefficients to
paste into optimum_qnn/exporter/memory.py and each row's residuals (tests/test_memory.py checks them against the module).

Usage: python benchmarks/memory_fit.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from e2b_width import e2b_config  # noqa: E402

from optimum_qnn.config import shard_starts  # noqa: E402
from optimum_qnn.exporter.memory import _BASE, _LOWER_BASE, GB_BYTES, ParameterCounts  # noqa: E402

ROWS_FILE = Path(__file__).parent / "memory_rows.json"


def load_rows() -> list[dict]:
    """The measured rows, each with its parameter counts (`counts`) added."""
    rows = json.loads(ROWS_FILE.read_text())["rows"]
    for row in rows:
        row["counts"] = ParameterCounts.from_config(e2b_config(row["depth"], row["reuse"]))
    return rows


def fit(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Stage -> its two coefficients (see the module docstring)."""
    coefficients = {}
    stages = [s for s in rows[0]["stages"] if s not in ("load", "lower")]
    for stage in stages:
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
    return counts.largest_shard(shard_starts(len(counts.layers), row["shards"]))


def main() -> int:
    rows = load_rows()
    coefficients = fit(rows)
    print("stage      coefficient 1   coefficient 2")
    for stage, (a, b) in coefficients.items():
        print(f"{stage:<10} {a:>13.3f}   {b:>13.3f}")
    print("\nresiduals (fit - measured, GB):")
    for row in rows:
        parts = []
        for stage, measured in row["stages"].items():
            if stage == "load":
                fitted = _BASE
            elif stage == "lower":
                r, s = coefficients["lower"]
                fitted = _LOWER_BASE + r * (_table_gb(row) + _rest_gb(row)) + s * _largest_shard(row) / GB_BYTES
            else:
                a, b = coefficients[stage]
                fitted = _BASE + a * _table_gb(row) + b * _rest_gb(row)
            parts.append(f"{stage} {fitted - measured:+.2f}")
        print(f"  {row['depth']} layers, {row['shards']} shards: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
