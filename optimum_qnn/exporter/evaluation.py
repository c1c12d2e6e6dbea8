"""What quantization and lowering did to a model: perplexity and logits SQNR of an exported .pte against fp32.

Both sides run through the same runner contract (`KVSession`): the reference is the static fp32 twin of the
Hugging Face model (equal to it, see tests/models), the exported side is the .pte on the HTP (or the x86
emulator). Text is cut into windows of the exported context, each starting with BOS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from optimum_qnn.errors import InvalidInputError
from optimum_qnn.metrics import sqnr_db  # noqa: F401  (part of this module's API)
from optimum_qnn.progress import bar
from optimum_qnn.session import KVSession

DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True)
class Scores:
    """Next-token statistics of one model over the evaluation windows."""

    tokens: int
    perplexity_reference: float
    perplexity_exported: float
    sqnr_db: float
    top1_agreement: float


def windows(ids: list[int], context_len: int, bos_id: int | None, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[torch.Tensor]:
    """Cut token ids into windows of at most ``context_len`` tokens (BOS first when the model has one), together
    predicting at most ``max_tokens`` tokens."""
    prefix = [] if bos_id is None else [bos_id]
    step = context_len - len(prefix)
    out, budget = [], max_tokens
    for start in range(0, len(ids), step):
        chunk = ids[start : start + min(step, budget + 1 - len(prefix))]
        window = prefix + chunk
        if len(window) < 2:
            break
        out.append(torch.tensor(window))
        budget -= len(window) - 1
        if budget <= 0:
            break
    return out


def score(reference: KVSession, exported: KVSession, texts: list[torch.Tensor], progress: bool = True) -> Scores:
    """Feed every window through both sessions; compare their next-token predictions."""
    nll_ref = nll_exp = 0.0
    agree = tokens = 0
    refs, gots = [], []
    for ids in bar(texts, "Evaluating", "window", enabled=progress):
        reference.reset()
        exported.reset()
        ref = reference.feed(ids).float()
        got = exported.feed(ids).float()
        targets = ids[1:]
        nll_ref += torch.nn.functional.cross_entropy(ref[:-1], targets, reduction="sum").item()
        nll_exp += torch.nn.functional.cross_entropy(got[:-1], targets, reduction="sum").item()
        agree += int((ref[:-1].argmax(-1) == got[:-1].argmax(-1)).sum())
        tokens += targets.numel()
        refs.append(ref)
        gots.append(got)
    if tokens == 0:
        raise InvalidInputError("The evaluation text has fewer than 2 tokens; pass a longer text file")
    return Scores(
        tokens=tokens,
        perplexity_reference=math.exp(nll_ref / tokens),
        perplexity_exported=math.exp(nll_exp / tokens),
        sqnr_db=sqnr_db(torch.cat(gots), torch.cat(refs)),
        top1_agreement=agree / tokens,
    )


def read_text(path: Path) -> str:
    """Plain text, or the ``text`` fields of a JSONL file."""
    from optimum_qnn.quantization.calibration import read_text_file

    return "\n\n".join(read_text_file(Path(path), "Evaluation text"))


def evaluate_variant(
    reference: KVSession, open_exported: Callable[[], KVSession], tokenizer, text_file: Path, context_len: int, bos_id: int | None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Scores:
    """Scores of one exported variant on ``text_file`` (tokenized with the model's tokenizer)."""
    if tokenizer is None:
        raise InvalidInputError("--evaluate needs the model's tokenizer, and the model folder has none")
    ids = tokenizer(read_text(text_file), add_special_tokens=False)["input_ids"]
    return score(reference, open_exported(), windows(ids, context_len, bos_id, max_tokens))


def staged_session(folder: Path, manifest) -> KVSession:
    """A KV session over a variant's .pte (staged or in place) in ExecuTorch's Python runtime, as the host backend
    runs it (`program.LoadedProgram`), without the runtime wing."""
    from optimum_qnn.artifacts.inspection import program_load_bytes
    from optimum_qnn.artifacts.manifest import resolve_inside
    from optimum_qnn.program import ExecClock, LoadedProgram, ProgramFacts, TimedMethod

    pte = resolve_inside(folder, manifest.program.path)
    loaded = LoadedProgram.get(pte, ProgramFacts.of(manifest), load_bytes=lambda: program_load_bytes(pte))
    clock = ExecClock()
    contract = manifest.runner_contract()
    return KVSession(contract, {m.name: TimedMethod(loaded, m.name, clock) for m in contract.methods})
