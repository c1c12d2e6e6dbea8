"""One console control for every command: without -v, `run`, `doctor` and `inspect` print their own output and no
line of the libraries under them (QNN's `[INFO] [Qnn ExecuTorch]` log, torchao's load failures, torch's deprecation
warnings, libQnnHtp's LIBNATIVE line); -v brings them back. Generation from Python (as `make demo` does) holds the
QNN runtime's lines back too, unless the `optimum_qnn.native` logger is enabled for DEBUG."""

from __future__ import annotations

import json

import pytest

# A line holding one of these comes from a library, not from optimum-qnn (tests/test_export.py checks the export's).
NOISE = ("[INFO]", "[WARNING]", "Qnn ExecuTorch", "Failed to load", "site-packages/torchao", "_pytree", "register_constant", "LIBNATIVE", "Warning:",
         "deprecat", "Deprecat", "WARNING root", "backend_opinfo")


def noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


@pytest.fixture(scope="module")
def commands(demo_kv_export) -> dict[str, tuple[list[str], str]]:
    """command -> (its arguments, a line of its own output)."""
    variant = demo_kv_export / json.loads((demo_kv_export / "qnn_index.json").read_text())["variants"][0]["path"]
    return {
        "run": (["run", str(demo_kv_export), "--prompt-ids", "2,40,41", "--max-new-tokens", "4"], "3 prompt + 4 new tokens"),
        "doctor": (["doctor", str(demo_kv_export)], "1 of 1 can run here"),
        "inspect": (["inspect", str(variant)], "target    SM8650, HTP v75"),
    }


@pytest.mark.parametrize("command", ["run", "doctor", "inspect"])
def test_commands_print_no_library_line_unless_verbose(commands, run_python, command):
    args, own_line = commands[command]
    quiet = run_python("-m", "optimum_qnn", *args)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert own_line in quiet.stdout, quiet.stdout
    assert not noise(quiet.stdout + quiet.stderr), noise(quiet.stdout + quiet.stderr)
    loud = run_python("-m", "optimum_qnn", *args, "-v")
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert own_line in loud.stdout
    shown = noise(loud.stdout + loud.stderr)
    assert any("LIBNATIVE" in line for line in shown), shown  # libQnnHtp, as it loads
    if command != "inspect":  # inspect never imports torchao
        assert any("Failed to load" in line for line in shown), shown
    if command == "run":  # the program was loaded and freed: the QNN runtime's own lines are back
        assert any("[INFO] [Qnn ExecuTorch]: Destroy Qnn context" in line for line in shown), shown


GENERATE = r"""
import logging, os, sys, torch
os.dup2(1, 2)  # one stream, in the order things were written
if sys.argv[2] == "verbose":
    logging.getLogger("optimum_qnn.native").setLevel(logging.DEBUG)
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
model = QNNModelForCausalLM.from_pretrained(sys.argv[1])
print("TOKENS", model.generate(torch.tensor([2, 40, 41]), max_new_tokens=4)[0].tolist(), flush=True)
if sys.argv[3] == "free":
    del model
print("END", flush=True)
"""


@pytest.mark.parametrize("ending", ["free", "keep"])
def test_generation_from_python_holds_back_the_qnn_runtime_lines(demo_kv_export, run_python, ending):
    """Loading, generating and freeing the program (with the model, or at exit when the model is still alive) prints
    no QNN line; with the native logger at DEBUG the same run prints them, the context destroyed where it was."""
    quiet = run_python("-c", GENERATE, str(demo_kv_export), "quiet", ending)
    assert quiet.returncode == 0, quiet.stdout[-3000:]
    assert "TOKENS [2, 40, 41, " in quiet.stdout
    assert not [line for line in quiet.stdout.splitlines() if "Qnn ExecuTorch" in line], quiet.stdout[-3000:]
    loud = run_python("-c", GENERATE, str(demo_kv_export), "verbose", ending)
    assert loud.returncode == 0, loud.stdout[-3000:]
    lines = loud.stdout.splitlines()
    assert any(line.startswith("[INFO] [Qnn ExecuTorch]: Deserializing") for line in lines), lines
    destroyed = lines.index("[INFO] [Qnn ExecuTorch]: Destroy Qnn context")
    # freed with the model (before END), or by the program's finalizer at exit (after it)
    assert (destroyed < lines.index("END")) == (ending == "free"), lines


@pytest.mark.parametrize("verbose", [False, True])
def test_the_console_log_reaches_the_terminal_while_qnn_s_output_is_held_back(tmp_path, verbose):
    """During a lowering (`quiet_native_output`) what the C++ libraries write to file descriptor 2 is held back, but
    the console's log handler (on that descriptor with -v) still writes there: this project's records keep their
    level (INFO with -v: the compile gate's decisions), executorch's are held at WARNING."""
    import logging
    import os

    from optimum_qnn.native_output import quiet_native_output

    terminal = tmp_path / "terminal"
    saved = os.dup(2)
    root = logging.getLogger()
    level = root.level
    with terminal.open("w") as f:
        os.dup2(f.fileno(), 2)
    handler = logging.StreamHandler(os.fdopen(2, "w", closefd=False))
    try:
        root.addHandler(handler)
        root.setLevel(logging.INFO if verbose else logging.WARNING)
        with quiet_native_output():
            os.write(2, b"QnnDsp <I> a native line\n")
            logging.getLogger("optimum_qnn.exporter.parallel_compile").info("Waiting for a compile to finish")
            logging.getLogger("executorch.exir").info("a pass ran")
            logging.getLogger("optimum_qnn.exporter.lowering").warning("a warning")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        os.dup2(saved, 2)
        os.close(saved)
    shown = terminal.read_text()
    assert "native line" not in shown and "a pass ran" not in shown and "a warning" in shown
    assert ("Waiting for a compile to finish" in shown) is verbose
