"""The cost of each extra SoC in one export: `--soc SM8550 SM8650 SM8750 SM8850` through the command users type.

Four exports, one after the other (benchmarks/e2b_full.py's `run_export`): the first SoC alone, the first two, three,
all four. Each loads, calibrates, quantizes and converts the graphs for QNN once, then lowers its SoCs, side by side
where the cores and the memory budget allow (`optimum_qnn.exporter.side_by_side`: one stage per wave of SoCs lowered
at once), and inspects and writes each. The k-th SoC's marginal cost is the export of k SoCs less the export of
k - 1, over the export of the first alone; each export is timed as the sum of its stages (the interpreter's start
is left out).
Rows go to benchmarks/multi_soc.json with the commit they ran on; prints a table. Run it alone.

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
    import recipe

    if name == "demo":
        import tiny_gemma4

        return tiny_gemma4.build(recipe.DEMO_DIR)
    depth = int(name.split("-", 1)[1])
    import e2b_width

    return e2b_width.build(recipe.CACHE / "bench-models" / f"e2b-width-{depth}", depth, recipe.DEPTHS[depth])


def measure(model: Path, quant: str, work: Path) -> dict:
    """Exports of the first k SoCs, k = 1..4, one after the other: the k-th SoC's marginal cost is what the export of
    k SoCs takes beyond the export of k - 1, over the export of the first alone."""
    import e2b_full

    exports = []
    for k in range(1, len(SOCS) + 1):
        run = e2b_full.run_export(model, work / f"out-{k}", SOCS[:k], quant, [])
        stages = {name: s for name, s, _ in run["stages"]}
        exports.append({"socs": list(SOCS[:k]), "export_s": round(sum(stages.values()), 1), "stages": stages})
    first = exports[0]["export_s"]
    socs = [{"soc": SOCS[k], "marginal": round((exports[k]["export_s"] - exports[k - 1]["export_s"]) / first, 3)}
            for k in range(1, len(SOCS))]
    waves = [{"socs": name.split(" ", 1)[1].split("+"), "lower_s": round(s, 1)}
             for name, s in exports[-1]["stages"].items() if name.startswith("lower ")]
    return {
        "first_soc_export_s": first, "export_s": exports[-1]["export_s"], "socs": socs,
        "marginal": round((exports[-1]["export_s"] - first) / (len(SOCS) - 1) / first, 3), "waves": waves,
        "exports": exports,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="demo, or e2b-N (Gemma-4-E2B widths, N layers)")
    parser.add_argument("--quant", default="16a8w")
    parser.add_argument("--work", type=Path, default=Path("/tmp/multi-soc"))
    args = parser.parse_args()
    from stored import source_commit

    args.work.mkdir(parents=True, exist_ok=True)
    result = measure(model_dir(args.model), args.quant, args.work)
    print(f"\n{args.model}, {args.quant}: {SOCS[0]} alone {result['first_soc_export_s']:.1f} s, all four "
          f"{result['export_s']:.1f} s: an extra SoC costs {result['marginal']:.2f}x of the first on average")
    print("| SoCs | export (s) | the last SoC's marginal cost |\n|---|---|---|")
    for export, row in zip(result["exports"], [None, *result["socs"]]):
        marginal = "-" if row is None else f"{row['marginal']:.2f}x"
        print(f"| {' '.join(export['socs'])} | {export['export_s']:.1f} | {marginal} |")
    print("\nIn the four-SoC export:\n| SoCs lowered at once | lower stage (s) |\n|---|---|")
    for wave in result["waves"]:
        print(f"| {' + '.join(wave['socs'])} | {wave['lower_s']:.1f} |")
    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {"runs": {}}
    stored["runs"][f"{args.model} {args.quant}"] = {**result, "commit": source_commit()}
    ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"stored in {ROWS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
