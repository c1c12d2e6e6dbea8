"""Several exports into one artifact folder at once (issue 27): the index, root files and model card are updated
under the folder's lock (`artifacts.folder_lock`), so no variant is lost; a lock held too long ends in a clear
error and leaves nothing half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from optimum_qnn.artifacts.writer import LOCK_NAME, STOP_AT_ENV, ArtifactError, folder_lock, read_index
from tests.conftest import REPO_ROOT, child_env

SOCS = ("SM8550", "SM8650", "SM8750")  # the first one stopped, two behind it: each would drop the other's entry
WAITING = "Waiting for "

_LOAD_AND_GENERATE = """
import sys, torch
from optimum_qnn.runtime.modeling import QNNModelForCausalLM
model = QNNModelForCausalLM.from_pretrained(sys.argv[1], soc=sys.argv[2])
assert model.manifest.target.soc == sys.argv[2]
out = model.generate(torch.tensor([2, 5, 6]), max_new_tokens=2, eos_token_id=[])
print(sys.argv[2], "ok" if out.shape == (1, 5) else "bad")
"""


class _Export:
    """A CLI export in a child process whose stderr is collected as it comes."""

    def __init__(self, model: Path, out: Path, soc: str, ctx: int = 32, env: dict | None = None):
        command = [
            sys.executable, "-m", "optimum_qnn", "export", "--model", str(model), "--output", str(out), "--soc", soc,
            "--quant", "fp16", "--mode", "kv", "--max-seq-len", str(ctx), "--embedding-quant", "none",
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**child_env(), **(env or {})}, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self.waiting = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if WAITING in line:
                self.waiting.set()

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=900)
        self._reader.join(timeout=30)
        return code, "".join(self.lines)

    def stopped(self) -> bool:
        return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="stops a child with SIGSTOP (POSIX)")
def test_exports_into_one_folder_at_once_keep_every_variant(random_model_dir, tmp_path):
    """The first export is stopped after it read the index (holding the lock); two more then finish their work and
    wait for the lock (without it they would write their entries, and the first one's stale index would drop them);
    a fourth with a 1 s lock timeout gives up with the clear error. Then the first resumes: all three variants land."""
    out = tmp_path / "out"
    first = _Export(random_model_dir, out, SOCS[0], env={STOP_AT_ENV: "index-read"})
    _until(lambda: first.stopped() or first.proc.poll() is not None, 600, "the first export stopped")
    assert first.proc.poll() is None, "".join(first.lines)[-3000:]
    others = [_Export(random_model_dir, out, soc) for soc in SOCS[1:]]
    impatient = _Export(random_model_dir, out, "SM8650", ctx=48, env={"OPTIMUM_QNN_LOCK_TIMEOUT": "1"})
    try:
        for e in [*others, impatient]:
            _until(lambda: e.waiting.is_set() or e.proc.poll() is not None, 900, "an export reached the lock")
        code, err = impatient.finish()
        assert code == 2 and f"{out / LOCK_NAME} for more than 1 s" in err, err[-3000:]
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    for e in [first, *others]:
        code, err = e.finish()
        assert code == 0, err[-3000:]
    index = read_index(out)
    assert sorted(v["soc"] for v in index["variants"]) == list(SOCS)
    # Nothing of the export that gave up: no ctx-48 variant, no staging folder.
    assert not any(out.rglob("fp16-ctx48-kv")) and not [p for p in out.iterdir() if p.name.startswith(".staging-")]
    card = (out / "README.md").read_text()
    for soc in SOCS:
        # from_pretrained's checks (every file's size and sha256, the SoC) and a generation, each in a process of
        # its own (the emulator segfaulted loading four SoCs' contexts into one process).
        check = subprocess.run([sys.executable, "-c", _LOAD_AND_GENERATE, str(out), soc], capture_output=True,
                               text=True, timeout=300, env=child_env(), cwd=REPO_ROOT)
        assert check.returncode == 0 and f"{soc} ok" in check.stdout, check.stderr[-2000:]
        assert soc in card


def test_a_lock_held_past_the_timeout_is_a_clear_error(tmp_path):
    with folder_lock(tmp_path):
        with pytest.raises(ArtifactError, match="more than 0.2 s") as err:  # another holder, even in this process
            with folder_lock(tmp_path, timeout=0.2):
                pass
    assert "wait for that export to finish" in str(err.value)
    with folder_lock(tmp_path, timeout=0.2):  # released when its holder let go
        pass
