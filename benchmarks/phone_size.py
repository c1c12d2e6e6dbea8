"""The .pte size of the phone build (weights shared between prefill and decode) per model and 4-bit scheme.

The emulator rows of RESULTS.md are built with weight sharing off (the x86 emulator cannot load shared contexts),
so their HTP weights are stored twice and a scheme's extra 8-bit weights weigh double. This exports the build a phone
gets, with the same settings as benchmarks/run.py otherwise, prints its size against plain 16a4w_block, and stores
each row in benchmarks/phone_size.json (keyed by model and scheme, with the commit it ran on; rows of models and
schemes not measured again are kept).

Usage: python benchmarks/phone_size.py [--models demo bench] [--schemes 16a4w_block 16a4w_e2b] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import run  # noqa: E402
import tiny_gemma4  # noqa: E402

ROWS_FILE = HERE / "phone_size.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(run.MODEL_DIRS), choices=list(run.MODEL_DIRS))
    parser.add_argument("--schemes", nargs="*", default=["16a4w_block", "16a4w_e2b"])
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()

    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.exporter.pipeline import export

    work = args.work or Path(tempfile.mkdtemp(prefix="optimum-qnn-phone-size-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "calib.txt").write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:64]))
    rows = []
    commit = run.source_commit()
    for model in args.models:
        tiny_gemma4.build(run.MODEL_DIRS[model], size=model)
        sizes = {}
        for scheme in args.schemes:
            config = run.scheme_config(scheme, weight_sharing=True)
            t0 = time.perf_counter()
            calibration = CalibrationSource(file=work / "calib.txt", limit=16)
            result = export(run.MODEL_DIRS[model], work / model / scheme, config, calibration=calibration)
            sizes[scheme] = (result.variants[0] / "model.pte").stat().st_size / 1024
            rows.append((model, scheme, sizes[scheme], sizes[scheme] / next(iter(sizes.values())), time.perf_counter() - t0))
    print("| model | scheme | phone .pte KB | / first scheme | export s |\n|---|---|---|---|---|")
    for model, scheme, kb, ratio, seconds in rows:
        print(f"| {model} | {scheme} | {kb:.1f} | {ratio:.3f}x | {seconds:.0f} |")
    stored = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.is_file() else {}
    for model, scheme, kb, ratio, seconds in rows:
        stored.setdefault(model, {})[scheme] = {"phone .pte KB": kb, "ratio to first scheme": ratio,
                                               "first scheme": args.schemes[0], "export s": seconds, "commit": commit}
    ROWS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
