"""The benchmarks' stored rows: where they live, the commit a row was measured at, a markdown table, and `lookup`,
which resolves the row keys that README.md, CHANGELOG.md and docs/ quote figures under (tests/test_figures.py checks
them). A leaf: it imports no other benchmark script.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def source_commit() -> str:
    """The commit a measurement runs on, `-dirty` when the code it runs (package, benchmarks, examples) has uncommitted
    changes: every stored row records it, so a figure can be traced to the code that produced it."""
    root = HERE.parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "optimum_qnn", "benchmarks/*.py", "examples"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return (commit or "unknown") + ("-dirty" if dirty else "")



def stored(name: str) -> dict:
    """A benchmarks/*.json file's rows ({} when the script that writes it has not run)."""
    path = HERE / name
    return json.loads(path.read_text()) if path.is_file() else {}


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)



def lookup(key: str) -> float:
    """The value a README figure quotes, by its row key: `FILE:PATH[|OP]`.

    FILE is a benchmarks/*.json name without `.json`; PATH walks it by `/`, and a list of rows is entered by the row
    whose `scheme` (or `depth`, `turn`, `soc`) is the next part. OP turns the value into what the prose shows: `median` (of a list),
    `min` (seconds to minutes), `%` (a fraction to percent), `/KEY` (the ratio to another row's value), `-KEY` (the
    difference), `rel%KEY` (the change against another row's value, in percent).

    Raises:
        KeyError: naming the part of the key that no row has.
    """
    key, _, op = key.partition("|")
    name, _, path = key.partition(":")
    value = stored(name + ".json")
    if not value:
        raise KeyError(f"no stored rows in benchmarks/{name}.json")
    parts, i = path.split("/"), 0
    while i < len(parts):
        part = parts[i]
        if isinstance(value, dict):
            # a field's name may hold a slash ("decode tok/s"): the longest run of parts that is a field
            part = next(("/".join(parts[i:j]) for j in range(len(parts), i, -1) if "/".join(parts[i:j]) in value), part)
            if part not in value:
                raise KeyError(f"{key}: no {part!r}")
            value = value[part]
        elif part.isdigit() and not any(isinstance(r, (dict, list)) for r in value):
            value = value[int(part)]  # a position in a row: [stage, seconds, GB]
        else:
            # a row of a list: a table row by its first cell (a stage's name), a benchmark row by scheme, depth or turn
            found = [r for r in value
                     if (r[0] if isinstance(r, list) else str(r.get("scheme", r.get("depth", r.get("turn", r.get("soc")))))) == part]
            if not found:
                raise KeyError(f"{key}: no row {part!r}")
            value = found[0]
        i += part.count("/") + 1
    if op == "median":
        return float(statistics.median(value))
    if op == "min":
        return value / 60
    if op == "MiB":  # bytes
        return value / 2**20
    if op == "%":
        return value * 100
    if op.startswith("rel%"):
        return (value / lookup(op[4:]) - 1) * 100
    if op.startswith("/"):
        return value / lookup(op[1:])
    if op.startswith("-"):
        return value - lookup(op[1:])
    if op:
        raise KeyError(f"{key}: unknown operation {op!r}")
    return float(value)

