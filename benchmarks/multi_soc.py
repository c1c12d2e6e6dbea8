"""The cost of each extra SoC in one export: `--soc SM8550 SM8650 SM8750 SM8850` through the command users type.

The export (run by benchmarks/e2b_full.py's `run_export`) loads, calibrates and quantizes once, then lowers,
inspects and writes per SoC, each step with its stage line; the marginal cost of the k-th SoC is its own stages over
the first SoC's whole export (the shared stages plus its own). Rows go to benchmarks/multi_soc.json with the commit they ran on; prints a table. Run it alone.

Models: the demo Gemma4 (`demo`), and Gemma-4-E2B's widths at a few layers (`e2b-N`, benchmarks/e2b_width.py).

Usage: python benchmarks/multi_soc.py [--model demo|e2b-2] [--quant 16a8w] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

SOCS = ("SM8550", "SM8650", "SM8750", "SM8850")
ROWS_FILE = HERE / "multi_soc.json"


def model_dir(name: str) -> Path:
    import run

    if name == "demo":
        import tiny_gemma4

        return tiny_gemma4.build(run.DEMO_DIR)
    depth = int(name.split("-", 1)[1])
    import e2b_width

    return e2b_width.build(run.CACHE / "bench-models" / f"e2b-width-{depth}", depth, run.DEPTHS[depth])


def measure(model: Path, quant: str, work: Path) -> dict:
    import e2b_full

    run = e2b_full.run_export(model, work / "out", SOCS, quant, [])
    stages = {name: s for name, s, _ in run["stages"]}
    shared = sum(s for name, s in stages.items() if not name.split(" ")[0] in ("lower", "inspect", "write"))
    per_soc = {soc: sum(stages.get(f"{step} {soc}", 0.0) for step in ("lower", "inspect", "write")) for soc in SOCS}
    first = shared + per_soc[SOCS[0]]
    return {
        "wall_s": round(run["wall_s"], 1), "shared_s": round(shared, 1), "first_soc_export_s": round(first, 1),
        "socs": [{"soc": soc, "own_s": round(per_soc[soc], 1), "marginal": round(per_soc[soc] / first, 3)} for soc in SOCS],
        "stages": stages,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, or e2b-N (Gemma-4-E2B widths, N layers)")
    parser.add_argument("--quant", default="16a8w")
    parser.add_argument("--work", type=Path, default=Path("/tmp/multi-soc"))
    args = parser.parse_args()
    import run

    args.work.mkdir(parents=True, exist_ok=True)
    result = measure(model_dir(args.model), args.quant, args.work)
    print(f"\n{args.model}, {args.quant}: shared stages {result['shared_s']:.1f} s, first SoC's whole export "
          f"{result['first_soc_export_s']:.1f} s, wall {result['wall_s']:.1f} s")
    print("| SoC | its lower + inspect + write (s) | marginal (of the first SoC's export) |\n|---|---|---|")
    for row in result["socs"]:
        print(f"| {row['soc']} | {row['own_s']:.1f} | {row['marginal']:.2f}x |")
    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {"runs": {}}
    stored["runs"][f"{args.model} {args.quant}"] = {**result, "commit": run.source_commit()}
    ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"stored in {ROWS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
