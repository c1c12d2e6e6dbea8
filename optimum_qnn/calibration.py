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
        if self.limit <= 0:
            raise ValueError(f"Calibration limit must be positive; got {self.limit}")

    def texts(self) -> list[str]:
        if self.file is not None:
            texts = read_text_file(Path(self.file))
        else:
            texts = list(DEFAULT_CALIBRATION_TEXT)
        texts = [t for t in texts if t.strip()][: self.limit]
        if not texts:
            raise InvalidInputError(f"No calibration text found in {self.file}")
        return texts


def read_text_file(path: Path) -> list[str]:
    """Samples of a ``.jsonl`` file (``text`` field) or of a plain text file (paragraphs)."""
    if not path.is_file():
        raise InvalidInputError(f"Calibration file {path} does not exist")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InvalidInputError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
        return texts
    return [p.strip() for p in raw.split("\n\n") if p.strip()]


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
