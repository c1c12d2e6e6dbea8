"""Shared, session-scoped test set-up."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Set before a child process starts, so they reach its loader and executorch; never inherited by accident.
_SDK_ENV = ("QNN_SDK_ROOT", "OPTIMUM_QNN_CACHE", "LD_LIBRARY_PATH")


@pytest.fixture(scope="session")
def qnn_sdk():
    """The QNN libraries of this test process (set up once; executorch's Qualcomm code needs them)."""
    from optimum_qnn.sdk import ensure_qnn_sdk

    return ensure_qnn_sdk()


def child_env() -> dict[str, str]:
    """This process's environment minus its QNN variables, with the repo importable: for child Python processes."""
    env = {k: v for k, v in os.environ.items() if k not in _SDK_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return env


def run_main(argv: Sequence[object], capsys) -> tuple[int, str, str]:
    """Run ``python -m optimum_qnn ARGV`` in this process (the commands' own code, no new interpreter); returns
    (exit code, stdout, stderr). The logging set-up the command makes is undone."""
    from optimum_qnn.__main__ import main

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        code = main([str(a) for a in argv])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    return code, out, err


RunPython = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="session")
def run_python() -> RunPython:
    """Run `python <args>` in a fresh interpreter of this venv with the repo importable.

    The QNN variables of this process are removed from the child's environment (so each test states the
    set-up it checks) and replaced by `env`.
    """

    def run(*args: str, env: Mapping[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**child_env(), **(env or {})}
        return subprocess.run(
            [sys.executable, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
        )

    return run


# --- builds shared by the processes of one run ------------------------------------------------------------------
# The suite may run in two processes (`pytest -n 2 --dist loadfile`; `make test` runs one). An export the tests of
# both use is built once per run, by whichever process asks first, under a lock; the other waits and reads it.

T = TypeVar("T")


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run_dir(tmp_path_factory) -> Path:
    """The folder of this pytest run: shared by its xdist worker processes (each has its own basetemp inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """``build(folder)`` once per test run, whichever process asks first; returns what it returned (pickled beside the
    folder for the other processes). A build that raised, or whose process died, is built again by the next caller."""
    root = run_dir(tmp_path_factory) / "shared-builds"
    folder, done = root / name, root / f"{name}.pickle"
    with _locked(root / f"{name}.lock"):
        if done.is_file():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        result = build(folder)
        done.write_bytes(pickle.dumps(result))
        return result


# --- Gemma4 models and exports shared by the export/runtime tests ------------------------------------------------

DEMO_CACHE = Path(os.environ.get("OPTIMUM_QNN_TEST_CACHE", Path.home() / ".cache" / "optimum-qnn" / "test-models"))


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The built-in demo Gemma4 (every trait on, trained briefly on local text, with its tokenizer).

    Built once per machine (cached by recipe version); training gives it peaked next-token distributions, so
    greedy comparisons test the export rather than ties between random logits.
    """
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    import tiny_gemma4

    out = DEMO_CACHE / "demo-gemma4"
    return _built_example("tiny_gemma4.py", [out], lambda: tiny_gemma4.is_built(out))


@pytest.fixture(scope="session")
def demo_assistant_dir(demo_model_dir) -> Path:
    """The demo model's assistant (MTP drafter), distilled from it on the demo corpus; built once per machine (cached
    by its recipe and the demo model's own stamp) beside the demo model."""
    import tiny_gemma4_assistant  # on sys.path through the demo_model_dir fixture

    out = DEMO_CACHE / "demo-gemma4-assistant"
    return _built_example("tiny_gemma4_assistant.py", [demo_model_dir, out],
                          lambda: tiny_gemma4_assistant.is_built(demo_model_dir, out))


def _built_example(script: str, args: Sequence[Path], is_built: Callable[[], bool]) -> Path:
    """Run examples/SCRIPT ARGS unless ``is_built()``; returns the last argument (the folder it writes)."""
    with _locked(DEMO_CACHE / f"{script}.lock"):  # both test processes may ask for it first
        if not is_built():  # trained in a fresh interpreter: nothing a test has set in this one changes it
            proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / script), *map(str, args)],
                                  env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=3600)
            assert proc.returncode == 0 and is_built(), proc.stderr[-3000:]
    return args[-1]


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """A tiny random Gemma4 checkpoint folder (every trait on), without a tokenizer."""
    from tests.gemma4_tiny import tiny_config, tiny_model

    def build(folder: Path) -> Path:  # random weights: one folder for every process, so all test the same model
        tiny_model(tiny_config()).save_pretrained(folder)
        return folder

    return built_once(tmp_path_factory, "random-gemma4", build)


RANDOM_SOCS = ("SM8650", "SM8750", "SM8850")


@pytest.fixture(scope="session")
def random_kv_export(random_model_dir, tmp_path_factory, qnn_sdk):
    """The random Gemma4 exported once, fp16 kv mode, context 32, for three SoCs (loaded and calibrated once,
    lowered per SoC): test_export checks the per-SoC lowering, test_hub publishes and loads it."""
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(
        socs=tuple(Soc.parse(s) for s in RANDOM_SOCS), quant=QuantScheme.FP16, mode=ExportMode.KV,
        shapes=ShapeConfig(32, 4), embedding_quant=EmbeddingQuant(0, 0),
    )
    return built_once(tmp_path_factory, "random-kv", lambda out: export(random_model_dir, out, config))


FP16_CTX, FP16_PREFILL = 96, 16


@pytest.fixture(scope="session")
def fp16_export(demo_model_dir, tmp_path_factory, qnn_sdk):
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.HYBRID, shapes=ShapeConfig(FP16_CTX, FP16_PREFILL),
        embedding_quant=EmbeddingQuant(0, 0), weight_sharing=False,
    )
    return built_once(tmp_path_factory, "fp16-out", lambda out: export(demo_model_dir, out, config))


@pytest.fixture(scope="session")
def fp16_model(fp16_export):
    from optimum_qnn.runtime.modeling import QNNModelForCausalLM

    return QNNModelForCausalLM.from_pretrained(fp16_export.output, soc="SM8650", quant="fp16")




KV_CTX = 64


@pytest.fixture(scope="session")
def demo_kv_export(demo_model_dir, tmp_path_factory, qnn_sdk) -> Path:
    """The demo Gemma4 exported fp16 in kv mode (decode method only), context 64, float embedding tables."""
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    config = ExportConfig(socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.KV,
                          shapes=ShapeConfig(KV_CTX, 4), embedding_quant=EmbeddingQuant(0, 0))
    return built_once(tmp_path_factory, "demo-kv", lambda out: export(demo_model_dir, out, config).output)


@pytest.fixture(scope="session")
def cli_16a8w_export(demo_model_dir, tmp_path_factory, run_python):
    """The demo Gemma4 exported through the command line: 16a8w hybrid in two shards, context 64, prefill 16,
    uint16 graph IO (the default), weights not shared, evaluated on held-out text. Returns (folder, process)."""
    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    def build(tmp: Path) -> tuple[Path, subprocess.CompletedProcess]:
        out = tmp / "out"
        paragraphs = tiny_gemma4.corpus().split("\n\n")
        calib = tmp / "calib.jsonl"  # the README's form: one {"text": ...} object per line; extra keys and blank lines allowed
        calib.write_text("".join(json.dumps({"text": p, "source": "corpus"}) + "\n" + ("\n" if i % 7 == 0 else "")
                                 for i, p in enumerate(paragraphs[:40])))
        held_out = tmp / "eval.txt"
        held_out.write_text("\n\n".join(paragraphs[-40:]))
        proc = run_python(
            "-m", "optimum_qnn", "export", "--model", str(demo_model_dir), "--output", str(out), "--soc", "SM8650",
            "--quant", "16a8w", "--mode", "hybrid", "--max-seq-len", "64", "--prefill-ar-len", "16", "--no-weight-sharing",
            "--embedding-quant", "8,0", "--shards", "2",
            "--calib-file", str(calib), "--calib-limit", "8", "--evaluate", str(held_out), "--evaluate-tokens", "189",
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out, proc

    return built_once(tmp_path_factory, "cli-16a8w", build)


# --- a sliding window shorter than the prefill chunk (ExecuTorch's runner applies the window to past columns only) --

WINDOW7_CTX, WINDOW7 = 64, 7


@pytest.fixture(scope="session")
def window7_model_dir(demo_model_dir, tmp_path_factory) -> Path:
    """The demo model with its sliding window cut from 16 to 7 tokens (same weights and tokenizer): a valid Gemma4
    config whose window is shorter than a prefill chunk of 8."""
    def build(parent: Path) -> Path:
        folder = parent / "model"
        shutil.copytree(demo_model_dir, folder)
        config = json.loads((folder / "config.json").read_text())
        config["sliding_window"] = WINDOW7
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        return folder

    return built_once(tmp_path_factory, "window7", build)


@pytest.fixture(scope="session")
def window7_export(window7_model_dir, tmp_path_factory, qnn_sdk):
    """Hybrid exports of the window-7 model, context 64, weights not shared, built on first use:
    (quant, prefill_ar_len[, block_len[, shards]]) -> artifact folder. 16a8w is calibrated on 8 corpus paragraphs and
    keeps uint16 IO. A ``block_len`` exports the blocks cache layout with blocks of that many slots, else the full
    layout; ``shards`` cuts the decoder into that many QNN contexts per method (default 1)."""
    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.contract import CacheLayout
    from optimum_qnn.exporter.pipeline import export

    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    built: dict[tuple[str, int, int | None, int], Path] = {}

    def get(quant: str, ar_len: int, block_len: int | None = None, shards: int = 1) -> Path:
        if (quant, ar_len, block_len, shards) in built:
            return built[quant, ar_len, block_len, shards]
        blocks = "" if block_len is None else f"-blocks{block_len}"

        def build(folder: Path) -> Path:
            out = folder / "out"
            scheme = QuantScheme.parse(quant)
            shapes = (ShapeConfig(WINDOW7_CTX, ar_len) if block_len is None else
                      ShapeConfig(WINDOW7_CTX, ar_len, cache_layout=CacheLayout.BLOCKS, cache_block_len=block_len))
            config = ExportConfig(
                socs=(Soc.SM8650,), quant=scheme, mode=ExportMode.HYBRID, shapes=shapes,
                embedding_quant=EmbeddingQuant(0, 0) if scheme is QuantScheme.FP16 else EmbeddingQuant(8, 0),
                weight_sharing=False, shards=None if shards == 1 else shards,
            )
            calibration = None
            if scheme is not QuantScheme.FP16:
                calib = folder / "calib.txt"
                calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:40]))
                calibration = CalibrationSource(file=calib, limit=8)
            export(window7_model_dir, out, config, calibration=calibration)
            return out

        built[quant, ar_len, block_len, shards] = built_once(
            tmp_path_factory, f"window7-{quant}-ar{ar_len}{blocks}-shards{shards}", build)
        return built[quant, ar_len, block_len, shards]

    return get


@pytest.fixture(scope="session")
def layouts_export(window7_model_dir, tmp_path_factory, qnn_sdk) -> Path:
    """One artifact folder holding three fp16 kv-mode variants of the window-7 model for SM8650 (weights not shared):
    context 128 in the full and in the ring cache layout, and context 64 in the full layout."""
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.contract import CacheLayout
    from optimum_qnn.exporter.pipeline import export

    def build(out: Path) -> Path:
        for context, layout in ((128, CacheLayout.FULL), (128, CacheLayout.RING), (64, CacheLayout.FULL)):
            config = ExportConfig(
                socs=(Soc.SM8650,), quant=QuantScheme.FP16, mode=ExportMode.KV,
                shapes=ShapeConfig(context, 4, cache_layout=layout), embedding_quant=EmbeddingQuant(0, 0),
                weight_sharing=False,
            )
            export(window7_model_dir, out, config)
        return out

    return built_once(tmp_path_factory, "layouts", build)


A16W8_CTX, A16W8_PREFILL = 64, 16


@pytest.fixture(scope="session")
def a16w8_export(demo_model_dir, tmp_path_factory, qnn_sdk):
    """16a8w exports of the demo model (weights not shared), built on first use: mode -> artifact folder."""
    from optimum_qnn.quantization.calibration import CalibrationSource
    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export

    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:40]))
    built = {}

    def get(mode: str) -> Path:
        if mode not in built:
            config = ExportConfig(
                socs=(Soc.SM8650,), quant=QuantScheme.A16W8, mode=ExportMode.parse(mode),
                shapes=ShapeConfig(A16W8_CTX, A16W8_PREFILL), embedding_quant=EmbeddingQuant(8, 0), weight_sharing=False,
            )
            built[mode] = built_once(tmp_path_factory, f"16a8w-{mode}", lambda out: export(
                demo_model_dir, out, config, calibration=CalibrationSource(file=calib, limit=8)).output)
        return built[mode]

    return get


@pytest.fixture(scope="session")
def block4_export(demo_model_dir, tmp_path_factory, qnn_sdk) -> Path:
    """The demo model at 16a4w_block (block 64) with 4-bit embedding tables in groups of 32 (so the CPU side runs
    `quantized_decomposed::embedding_4bit`), hybrid, context 64, weights not shared, calibrated on 8 paragraphs."""
    import tiny_gemma4  # on sys.path through the demo_model_dir fixture

    from optimum_qnn.config import EmbeddingQuant, ExportConfig, ExportMode, QuantScheme, ShapeConfig, Soc
    from optimum_qnn.exporter.pipeline import export
    from optimum_qnn.quantization.calibration import CalibrationSource

    config = ExportConfig(
        socs=(Soc.SM8650,), quant=QuantScheme.A16W4_BLOCK, mode=ExportMode.HYBRID, shapes=ShapeConfig(64, 16),
        embedding_quant=EmbeddingQuant(4, 32), weight_sharing=False,
    )

    def build(folder: Path) -> Path:
        calib = folder / "block4-calib.txt"
        calib.write_text("\n\n".join(tiny_gemma4.corpus().split("\n\n")[:40]))
        out = folder / "out"
        export(demo_model_dir, out, config, calibration=CalibrationSource(file=calib, limit=8))
        return out

    return built_once(tmp_path_factory, "block4", build)


# --- the order files are dealt in ---------------------------------------------------------------------------------
# Under `make test` (xdist, --dist loadfile --no-loadscope-reorder) each process takes the next file in collection
# order when it is free: the longest files go first, so that neither process is left alone with a long one at the end.
# Ranked by the summed test times of a fresh clone's two-process run (`--junitxml`, 2026-12-07: test_ort_program 1174 s,
# test_blocks_emulator 1080, test_lookahead 983, test_demo_assistant 855 (training the assistant), test_chat 791, ...).
LONGEST_FILES = (
    "tests/runtime/backends/test_ort_program.py", "tests/test_lookahead.py", "tests/test_blocks_emulator.py",
    "tests/test_demo_assistant.py", "tests/test_chat.py", "tests/test_weights.py", "tests/test_window_chunks.py",
    "tests/test_image_export.py", "tests/test_image_quant.py", "tests/test_concurrent_writers.py",
    "tests/test_assistant_export.py",
    "tests/test_export.py", "tests/models/gemma4/test_assistant_lowering.py", "tests/models/gemma4/test_vision_lowering.py",
    "tests/runtime/test_speculative_assistant.py", "tests/test_bad_input.py", "tests/models/gemma4/test_parity.py",
    "tests/test_console.py", "tests/test_lowering.py", "tests/test_runtime_venv.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
