"""The cost of each extra SoC in one export: `--soc SM8550 SM8650 SM8750 SM8850` through the command users type.

Two exports, one after the other (benchmarks/e2b_full.py's `run_export`): the first SoC alone, then all four. Both
load, calibrate, quantize and convert the graphs for QNN once; the four-SoC export then lowers the SoCs, side by side
where the cores and the memory budget allow (`optimum_qnn.exporter.side_by_side`: one stage per wave of SoCs lowered
at once), and inspects and writes each. The marginal cost of an extra SoC is (four-SoC export - one-SoC export) / 3,
over the one-SoC export, each export timed as the sum of its stages (the interpreter's start is left out of both).
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
    import run

    if name == "demo":
        import tiny_gemma4

        return tiny_gemma4.build(run.DEMO_DIR)
    depth = int(name.split("-", 1)[1])
    import e2b_width

    return e2b_width.build(run.CACHE / "bench-models" / f"e2b-width-{depth}", depth, run.DEPTHS[depth])


def measure(model: Path, quant: str, work: Path) -> dict:
    import e2b_full

    def export(socs) -> tuple[float, dict[str, float]]:
        run = e2b_full.run_export(model, work / f"out-{len(socs)}", socs, quant, [])
        stages = {name: s for name, s, _ in run["stages"]}
        return sum(stages.values()), stages

    first, first_stages = export(SOCS[:1])
    total, stages = export(SOCS)
    waves = [{"socs": name.split(" ", 1)[1].split("+"), "lower_s": round(s, 1)} for name, s in stages.items()
             if name.startswith("lower ")]
    return {
        "first_soc_export_s": round(first, 1), "export_s": round(total, 1),
        "marginal": round((total - first) / (len(SOCS) - 1) / first, 3), "waves": waves,
        "stages": stages, "first_soc_stages": first_stages,
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
    print(f"\n{args.model}, {args.quant}: {SOCS[0]} alone {result['first_soc_export_s']:.1f} s, all four "
          f"{result['export_s']:.1f} s: an extra SoC costs {result['marginal']:.2f}x of the first")
    print("| SoCs lowered at once | lower stage (s) |\n|---|---|")
    for wave in result["waves"]:
        print(f"| {' + '.join(wave['socs'])} | {wave['lower_s']:.1f} |")
    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {"runs": {}}
    stored["runs"][f"{args.model} {args.quant}"] = {**result, "commit": run.source_commit()}
    ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
    print(f"stored in {ROWS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
