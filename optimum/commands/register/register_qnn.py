"""`optimum-cli export qnn`: registered through optimum's command-plugin namespace (PEP 420, no __init__.py).

Heavy imports happen inside `run()` so `optimum-cli --help` stays fast.
"""

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
from optimum.commands.export.base import ExportCommand


class QnnExportCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(name="qnn", help="Export a Gemma4 text model to Qualcomm HTP (ExecuTorch QNN backend).")

    @staticmethod
    def parse_args(parser) -> None:
        from optimum_qnn.cli import add_export_arguments

        add_export_arguments(parser)

    def run(self) -> int:
        from optimum_qnn.cli import run_export

        code = run_export(self.args)
        if code:
            raise SystemExit(code)  # optimum-cli ignores run()'s return value
        return 0


REGISTER_COMMANDS = [(QnnExportCommand, ExportCommand)]
