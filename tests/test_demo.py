"""`examples/demo.py`, the README's first command (`make demo`), end to end in a fresh interpreter."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.slow  # one 16a8w export of the demo model and a generation on the emulator: about 3 min on 2 cores
def test_demo_exports_generates_and_prints_its_parity(demo_model_dir, run_python, tmp_path, qnn_sdk):
    out = tmp_path / "demo"
    shutil.copytree(demo_model_dir, out / "model")  # the same recipe's build: the demo reuses it instead of training
    result = run_python(str(REPO_ROOT / "examples" / "demo.py"), "--out", str(out), timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    text = result.stdout
    print(text)
    steps = [line for line in text.splitlines() if line.startswith("== ")]
    assert [s.split(" ", 2)[1] for s in steps] == ["1/3", "2/3", "3/3"]
    (variant,) = (out / "artifact").glob("qnn/sm8650/*/model.pte")
    assert f"-> {variant.parent}" in text
    assert re.search(r"(?m)^output : '.+'$", text)  # some text came back
    speed = re.search(r"decode (\d+\.\d) tok/s \(x86 emulator", text)
    assert speed and float(speed.group(1)) > 0
    parity = re.search(
        r"parity : greedy tokens equal to fp32 Hugging Face for (\d+) of (\d+).*; teacher-forced top-1 (\d+)/(\d+); "
        r"logits SQNR (-?\d+\.\d) dB", text)
    assert parity, text
    first, n, forced, n2, sqnr = *map(int, parity.groups()[:4]), float(parity.group(5))
    assert 0 < n == n2 and first <= n
    if first < n:  # a greedy run that parts from fp32 says where and by how little fp32 itself chose
        assert re.search(r"where they part, fp32's top two logits are \d+\.\d{3} apart", text)
    assert "The stable figures are the teacher-forced top-1 and the logits SQNR" in text  # the last lines explain it
    # The bound comes from the stored 16a8w row of the demo model (benchmarks/rows.json, schemes/16a8w: top-1 over
    # 1024 held-out tokens, teacher-forced): the expected misses in n positions, plus 3 (at a miss rate of about 1 %,
    # 4 or more extra misses in 32 positions happen less than once in a thousand runs).
    row = next(r for r in json.loads((REPO_ROOT / "benchmarks" / "rows.json").read_text())["schemes"] if r["scheme"] == "16a8w")
    assert forced >= n * row["top-1"] - 3, (forced, n, row["top-1"])
    assert sqnr >= row["SQNR dB"] - 6, (sqnr, row["SQNR dB"])  # one prompt's 39 positions against the row's 1024 tokens
    # What the libraries print is held back without -v: nothing but the demo's own lines on stdout.
    assert not [line for line in text.splitlines() if "[INFO]" in line or "Warning" in line]


def test_the_parity_line_is_explained_in_plain_words():
    """The demo's last lines: the stable figures, and what a greedy count that stops early at a near tie means."""
    import sys

    sys.path.insert(0, str(REPO_ROOT / "examples"))
    from demo import parity_meaning

    parted = " ".join(parity_meaning(7, 32, 0.0123).split())
    assert parted.startswith("The stable figures are the teacher-forced top-1 and the logits SQNR")
    assert "first token that differs (token 8 of 32)" in parted and "top two logits are 0.012 apart" in parted
    assert "near tie" in parted
    whole = " ".join(parity_meaning(32, 32, None).split())
    assert "ran to the end: both models generated the same 32 tokens" in whole and "near tie" not in whole
    assert all(len(line) <= 127 for line in parity_meaning(7, 32, 0.0123).splitlines())
