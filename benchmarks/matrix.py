"""The export matrix (schemes x SoCs): measured at small scale here, and on paper at full scale from stored rows.

measure: the demo Gemma4, `--soc SM8650 SM8750 --quant 16a8w 16a4w` through the command users type, (1) on this
    machine, (2) with `--ray` on a 2-node Ray cluster on loopback (tests/ray_cluster.py: both nodes share this
    machine's cores, so the row measures each cell's cost and the cluster's overhead, not a speed-up). Rows go to
    benchmarks/matrix.json with the commit they ran on. Run it alone.
paper: Gemma-4-E2B and E4B x 4 phone SoCs x 2 schemes from the stored full-size single-SoC exports
    (benchmarks/e2b_full.json, e4b_full.json; one scheme's stages stand in for both), as estimates whose arithmetic
    is printed:
    - driver D: load + swap + export + calibrate + quantize, once per scheme;
    - cell C: the lowering of one SoC (ExecuTorch's edge conversion included, as a Ray cell does it);
    - write W: inspect + write, on the driver, per cell;
    - N nodes: S x D + ceil(S x K / N) x C + S x K x W (no overlap of the driver's next scheme with the cells); for
      one node that is every SoC lowered in full, an upper bound of a local export (which converts the graphs for
      QNN once per scheme).

Usage: python benchmarks/matrix.py measure [--work DIR] | paper
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

ROWS_FILE = HERE / "matrix.json"
SOCS = ("SM8650", "SM8750")
SCHEMES = ("16a8w", "16a4w")
PAPER_SOCS, PAPER_SCHEMES, PAPER_NODES = 4, 2, (1, 2, 4, 8)
DRIVER = ("load", "swap", "export", "calibrate", "quantize", "edge")
_CELL = re.compile(r"\[lower (?P<scheme>\S+) (?P<soc>\S+)\] done in (?P<s>[\d.]+) s")


def _sums(stages: list) -> dict[str, float]:
    """Driver, lowering and writing seconds of one export's stage lines (a matrix repeats them per scheme)."""
    out = {"driver": 0.0, "lower": 0.0, "write": 0.0}
    for name, seconds, _ in stages:
        step = name.split(" ")[0]
        out["driver" if step in DRIVER else "lower" if step == "lower" else "write"] += seconds
    return {k: round(v, 1) for k, v in out.items()}


def measure(work: Path) -> dict:
    import e2b_full
    import recipe
    import tiny_gemma4

    from tests.ray_cluster import loopback_cluster

    model = tiny_gemma4.build(recipe.DEMO_DIR)
    local = e2b_full.run_export(model, work / "local", SOCS, SCHEMES, [])
    with loopback_cluster(work / "cluster") as cluster:
        remote = e2b_full.run_export(model, work / "ray", SOCS, SCHEMES, ["--ray", cluster.address])
    log = (work / "ray.log").read_text()
    cells = [{"cell": f"{m['scheme']} {m['soc']}", "s": float(m["s"])} for m in _CELL.finditer(log)]
    rows = {}
    for name, result in (("local", local), ("ray 2 nodes", remote)):
        rows[name] = {"wall_s": round(result["wall_s"], 1), "cpu_percent": result.get("cpu_percent"),
                      **_sums(result["stages"])}
    rows["ray 2 nodes"]["cells"] = cells
    cell_mean = sum(c["s"] for c in cells) / len(cells)
    # The paper formula at this scale, from this run's own measured parts: does it hold where it can be checked?
    driver = rows["ray 2 nodes"]["driver"] / len(SCHEMES)
    write = rows["ray 2 nodes"]["write"] / (len(SCHEMES) * len(SOCS))
    predicted = (len(SCHEMES) * driver + math.ceil(len(SCHEMES) * len(SOCS) / 2) * cell_mean
                 + len(SCHEMES) * len(SOCS) * write)
    rows["ray 2 nodes"]["formula_s"] = round(predicted, 1)
    return rows


def paper() -> list[dict]:
    """The full-scale matrix from stored single-SoC rows (see the module docstring)."""
    sources = {"Gemma-4-E2B": ("e2b_full.json", "auto@16GB"), "Gemma-4-E4B": ("e4b_full.json", "42")}
    table = []
    for model, (file, key) in sources.items():
        row = json.loads((HERE / file).read_text())["runs"][key]
        parts = _sums(row["stages"])
        d, c, w = parts["driver"], parts["lower"], parts["write"]
        s, k = PAPER_SCHEMES, PAPER_SOCS
        entry = {"model": model, "row": f"{file}:{key}", "D": d, "C": c, "W": w}
        for n in PAPER_NODES:
            entry[f"{n} nodes"] = round(s * d + math.ceil(s * k / n) * c + s * k * w)
        table.append(entry)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("measure", "paper"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/matrix-bench"))
    args = parser.parse_args()
    if args.what == "paper":
        print(f"Estimates (s), {PAPER_SCHEMES} schemes x {PAPER_SOCS} SoCs, from measured single-SoC stages:")
        print("| model | row | D | C | W | " + " | ".join(f"{n} node(s)" for n in PAPER_NODES) + " |")
        print("|---" * (5 + len(PAPER_NODES)) + "|")
        for e in paper():
            print(f"| {e['model']} | {e['row']} | {e['D']:.0f} | {e['C']:.0f} | {e['W']:.0f} | "
                  + " | ".join(str(e[f"{n} nodes"]) for n in PAPER_NODES) + " |")
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    rows = measure(args.work)
    print(f"\ndemo, --soc {' '.join(SOCS)} --quant {' '.join(SCHEMES)}:")
    print("| run | wall s | driver s | lowering s | write s |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['wall_s']:.1f} | {r['driver']:.1f} | {r['lower']:.1f} | {r['write']:.1f} |")
    ray_row = rows["ray 2 nodes"]
    print("cells: " + ", ".join(f"{c['cell']} {c['s']:.1f} s" for c in ray_row["cells"])
          + f"; the paper formula on these parts: {ray_row['formula_s']:.1f} s")
    import e2b_full

    for name, r in rows.items():
        e2b_full.store(ROWS_FILE, f"demo {name}", r)
    print(f"stored in {ROWS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
