"""`python -m optimum_qnn <command>`.

Each command is one `_add_<name>` function that registers its parser and sets `handler` (a function taking the
parsed arguments and returning an exit code); list it in `_COMMANDS`. Handlers import their heavy modules
themselves so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="show versions, the QNN libraries and ExecuTorch backend in use, and what this host can run"
    )
    parser.add_argument("path", nargs="?", help="an artifact folder: say which of its variants this host can run")

    def handler(args: argparse.Namespace) -> int:
        from optimum_qnn.doctor import run_doctor

        return run_doctor(args.path)

    parser.set_defaults(handler=handler)


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("export", help="export a Gemma4 model to QNN (same as `optimum-cli export qnn`)")
    from optimum_qnn.cli import add_export_arguments, run_export

    add_export_arguments(parser)
    parser.set_defaults(handler=run_export)


def _add_inspect(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="show the QNN context binaries of a .pte: target, graphs, IO, encodings, weight sharing, size"
    )
    parser.add_argument("path", help="a .pte file, or a variant folder holding model.pte")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")

    def handler(args: argparse.Namespace) -> int:
        import json
        import os
        from pathlib import Path

        from optimum_qnn.errors import OptimumQnnError
        from optimum_qnn.inspection import inspect_pte

        path = Path(args.path) / "model.pte" if Path(args.path).is_dir() else Path(args.path)
        stdout = os.dup(1)
        os.dup2(2, 1)  # the QNN libraries print to the process's stdout: keep it for the report (--json stays JSON)
        try:
            report = inspect_pte(path)
        except OptimumQnnError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            os.dup2(stdout, 1)
            os.close(stdout)
        print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
        return 0

    parser.set_defaults(handler=handler)


_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_doctor, _add_export, _add_inspect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optimum_qnn", description="Export Gemma4 text models to Qualcomm HTP.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
