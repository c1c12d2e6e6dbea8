"""Calibration text: read it, tokenize it, and run it through prepared graphs the way a device runner would."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from optimum_qnn.errors import InvalidInputError

logger = logging.getLogger(__name__)

# Used when the user gives no calibration text: a few varied sentences, so that every activation sees data.
# Real exports should pass --calib-file with text of the target domain.
DEFAULT_CALIBRATION_TEXT = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "Qualcomm's Hexagon NPU runs quantized neural networks efficiently on phones and laptops.",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon; Neil Armstrong stepped out first.",
    "Question: what is the capital of France? Answer: Paris is the capital and largest city of France.",
]


@dataclass(frozen=True)
class CalibrationSource:
    """Where calibration text comes from: a local file or the built-in sentences.

    No `datasets` source: `datasets` is not a dependency of this package. A dataset saved as JSONL
    (``ds.to_json("calib.jsonl")``) is read as a file.

    Args:
        file: plain text (one sample per blank-line separated paragraph) or JSONL (a ``text`` field per line).
        limit: keep at most this many samples.
    """

    file: Path | None = None
    limit: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit <= 0:
            raise InvalidInputError(f"--calib-limit must be a positive integer; got {self.limit!r}")

    def texts(self) -> list[str]:
        if self.file is not None:
            texts = read_text_file(Path(self.file), "Calibration")
        else:
            texts = list(DEFAULT_CALIBRATION_TEXT)
        texts = [t for t in texts if t.strip()][: self.limit]
        if not texts:
            raise InvalidInputError(f"No calibration text found in {self.file}")
        return texts


def read_text_file(path: Path, what: str = "Text") -> list[str]:
    """Samples of a ``.jsonl`` file (``text`` field, a string) or of a plain text file (paragraphs)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"{what} file {path} does not exist" + (" (it is a folder)" if path.is_dir() else ""))
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"{what} file {path} is not UTF-8 text ({e.reason} at byte {e.start}); pass a text or JSONL file") from None
    except OSError as e:
        raise InvalidInputError(f"Cannot read {what.lower()} file {path}: {e.strerror or e}") from None
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError):
                raise InvalidInputError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
            if not isinstance(text, str):
                raise InvalidInputError(
                    f"{path}:{n}: the 'text' field is {type(text).__name__} {text!r:.40}, not a string; fix that line"
                )
            texts.append(text)
        return texts
    return [p.strip() for p in raw.split("\n\n") if p.strip()]


def check_text_file(path: Path, what: str) -> list[str]:
    """Read ``path`` as `read_text_file` does and refuse it when it holds no text (before any long work)."""
    texts = [t for t in read_text_file(Path(path), what) if t.strip()]
    if not texts:
        raise InvalidInputError(f"{what} file {path} holds no text")
    return texts


def token_sequences(tokenizer, texts: Iterable[str], max_len: int, bos_id: int | None) -> list[list[int]]:
    """Tokenize each sample (BOS first when the model has one), truncated to ``max_len`` tokens."""
    seqs = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if bos_id is not None:
            ids = [bos_id] + ids
        if len(ids) >= 2:
            seqs.append(ids[:max_len])
    if not seqs:
        raise InvalidInputError("Calibration text produced no token sequence of at least 2 tokens")
    return seqs
