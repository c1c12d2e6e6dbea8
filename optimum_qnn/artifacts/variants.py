"""Choosing one variant of an artifact folder and checking its files against its manifest (no runtime needed:
the Hub download and `from_pretrained` share these): by SoC, scheme, cache layout and context, the context by the
memory the host has when the request names none."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from optimum_qnn.artifacts.manifest import Manifest, ManifestError, resolve_inside, sha256_file
from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.host_memory import GB_BYTES, available_memory, default_budget_gib

logger = logging.getLogger(__name__)


class VariantNotFoundError(OptimumQnnError):
    """No exported variant matches the requested SoC / quant scheme / context / cache layout."""


# `select_variant(speculative=AUTO_SPECULATIVE)`: where one SoC, scheme, context and layout were exported for several
# decodings, the assistant's, else lookahead, else plain (what `chat` and `serve` load by default)
AUTO_SPECULATIVE = "auto"
# `optimum_qnn.contract.CacheLayout`'s values, as the index spells them
FULL_LAYOUT, RING_LAYOUT, BLOCKS_LAYOUT = "full", "ring", "blocks"
LAYOUTS = (FULL_LAYOUT, RING_LAYOUT, BLOCKS_LAYOUT)
# The one-line notices of a command (shown without -v, as the exporter's stage lines are).
notice = logging.getLogger("optimum_qnn.stages")


def entry_layout(entry: dict[str, Any]) -> str:
    """An index entry's cache layout. Indexes written before the layout was recorded hold full-layout variants only
    (a ring variant was never indexed without it)."""
    return entry.get("cache_layout", FULL_LAYOUT)


def describe(entry: dict[str, Any]) -> str:
    """``SM8650/fp16/ctx64/hybrid`` (``/ring`` or ``/blocks`` appended for those layouts, ``/asstK`` for an assistant
    drafting K tokens a round, ``/imgN`` for an image variant of N soft tokens an image): how an error lists a
    variant."""
    ring = "" if entry_layout(entry) == FULL_LAYOUT else f"/{entry_layout(entry)}"
    assistant = f"/asst{entry['assistant']['draft_len']}" if entry.get("assistant") else ""
    images = f"/img{entry['images']['soft_tokens']}" if entry_takes_images(entry) else ""
    return f"{entry['soc']}/{entry['quant']}/ctx{entry['context_len']}/{entry['mode']}{ring}{assistant}{images}"


def entry_takes_images(entry: dict[str, Any]) -> bool:
    """Whether an index entry's variant holds a vision encoder (``export --task image-text-to-text``)."""
    return bool(entry.get("images"))


def entry_speculative(entry: dict[str, Any]) -> str | None:
    """The speculative decoding an index entry's variant was exported for: ``"assistant"`` (a drafter in its
    program), ``"lookahead"`` (``--mode lookahead``), or None (plain decoding)."""
    if entry.get("assistant"):
        return "assistant"
    return "lookahead" if entry.get("mode") == "lookahead" else None


def select_variant(
    index: dict[str, Any], soc: str | None, quant: str | None, context_len: int | None,
    cache_layout: str | None = None, *, prefer_layout: str = FULL_LAYOUT, fit: "MemoryFit | None" = None,
    speculative: str | None = None, images: bool = False,
) -> dict[str, Any]:
    """The index entry matching the request (None matches anything); a miss lists what exists.

    ``images``: only the variants that take images (`QNNModelForImageTextToText`); without it a variant that takes
    images is set aside for its text-only twin (same SoC, scheme, context, layout and mode), whose prefill is the
    cheaper graph.

    Where the request leaves a choice:
    - variants of the same SoC, scheme, context and layout exported for different decodings (plain, ``-asstK``,
      lookahead): the one for ``speculative`` (``"assistant"``, ``"lookahead"``), and with None the plain one (a
      variant built to verify several tokens a call pays for them on every plain call too), with
      ``AUTO_SPECULATIVE`` the fastest there is; one line names the others and how to load them. A ``speculative`` no candidate was exported for keeps them all: the caller's
      check refuses it with the fix;
    - the same SoC, scheme, context and mode in both cache layouts: the ``prefer_layout`` one (the in-process
      backends prefer the ring, which moves fewer bytes per call for the same output; ExecuTorch's C++ runner reads
      the full layout only);
    - several contexts of one SoC, scheme and mode, and no ``context_len``: ``fit`` chooses (the largest context
      whose memory need fits), or without it the request is ambiguous.

    Raises:
        VariantNotFoundError: nothing matches (a context that no variant has lists the contexts there are), or
            several do and the request does not say which.
    """
    if cache_layout is not None and cache_layout not in LAYOUTS:
        raise VariantNotFoundError(f"Unknown cache layout {cache_layout!r}; expected one of: {', '.join(LAYOUTS)}")
    want = {"soc": soc.upper() if soc else None, "quant": quant, "context_len": context_len}
    hits = [
        v for v in index["variants"]
        if all(val is None or v.get(key) == val for key, val in want.items())
        and cache_layout in (None, entry_layout(v))
    ]
    if images:
        if hits and not any(entry_takes_images(v) for v in hits):
            raise VariantNotFoundError(
                f"No variant that matches takes images ({', '.join(describe(v) for v in hits)}: exported for text "
                "generation): export one with --task image-text-to-text, or load these with QNNModelForCausalLM"
            )
        hits = [v for v in hits if entry_takes_images(v)]
    elif len(hits) > 1:
        hits = _prefer(hits, entry_takes_images, False, lambda v: (*_but_context(v)[:-1], v.get("context_len"), entry_layout(v)))
    if len(hits) > 1:
        hits = _speculative_choice(hits, speculative)
    if len(hits) > 1 and cache_layout is None:
        hits = _preferred_layout(hits, prefer_layout)
    if len(hits) > 1 and context_len is None and fit is not None and len({_but_context(v) for v in hits}) == 1:
        return fit.choose(hits)
    if len(hits) == 1:
        return hits[0]
    available = ", ".join(describe(v) for v in index["variants"]) or "none"
    asked = f"soc={soc}, quant={quant}, context_len={context_len}" + (f", cache_layout={cache_layout}" if cache_layout else "")
    if not hits and context_len is not None:
        others = select_contexts(index, soc, quant)
        if others and context_len not in others:
            raise VariantNotFoundError(
                f"No variant has a context of {context_len} tokens (--max-seq-len); the contexts there are: "
                f"{', '.join(map(str, others))}. Available: {available}"
            )
    if not hits:
        raise VariantNotFoundError(f"No variant for {asked}; available: {available}")
    several = f"soc={soc}, quant={quant}" + (f", cache_layout={cache_layout}" if cache_layout else "")
    raise VariantNotFoundError(f"Several variants match {several}; be more specific. Available: {available}")


def select_contexts(index: dict[str, Any], soc: str | None, quant: str | None) -> list[int]:
    """The contexts of the variants of ``soc`` and ``quant`` (None: any), ascending."""
    soc = soc.upper() if soc else None
    return sorted({v["context_len"] for v in index["variants"] if soc in (None, v.get("soc")) and quant in (None, v.get("quant"))})


def _but_context(entry: dict[str, Any]) -> tuple:
    """What variants that differ only in context share (after `_preferred_layout`, one layout per context)."""
    return entry.get("soc"), entry.get("quant"), entry.get("mode"), entry_speculative(entry), entry_takes_images(entry)


def _speculative_choice(hits: list[dict[str, Any]], speculative: str | None) -> list[dict[str, Any]]:
    """``hits`` less each variant whose twin of another decoding (same SoC, scheme, context, layout) is the one for
    ``speculative`` (None: plain decoding). The variants set aside are named in one line, with how to load them."""
    if speculative == AUTO_SPECULATIVE:  # the first decoding a candidate was exported for, of this order
        present = {entry_speculative(v) for v in hits}
        speculative = next(kind for kind in ("assistant", "lookahead", None) if kind in present)
    kept = _prefer(hits, entry_speculative, speculative,
                   lambda v: (v.get("soc"), v.get("quant"), v.get("context_len"), entry_layout(v)))
    aside = [v for v in hits if v not in kept]
    if aside:
        how = "; ".join(
            f"{describe(v)} loads with speculative={entry_speculative(v)!r} "
            + (f"(--speculative {entry_speculative(v)})" if entry_speculative(v) else "(no --speculative)")
            for v in aside
        )
        notice.info("The variant for %s decoding; %s", speculative or "plain", how)
    return kept


def _preferred_layout(hits: list[dict[str, Any]], prefer: str) -> list[dict[str, Any]]:
    """``hits`` less each variant whose twin in the other layout (same SoC, scheme, context, mode) is ``prefer``."""
    return _prefer(hits, entry_layout, prefer, lambda v: (v.get("soc"), v.get("quant"), v.get("context_len"), v.get("mode")))


def _prefer(hits: list[dict[str, Any]], kind: Callable[[dict[str, Any]], Any], wanted: Any,
            twin: Callable[[dict[str, Any]], tuple]) -> list[dict[str, Any]]:
    """``hits`` less each variant of another ``kind`` than ``wanted`` whose twin (the same ``twin`` key) is of it."""
    preferred = {twin(v) for v in hits if kind(v) == wanted}
    return [v for v in hits if kind(v) == wanted or twin(v) not in preferred]


def memory_need_bytes(manifest: Manifest) -> int:
    """A variant's memory in a running process, estimated from its manifest: the program file (held once loaded:
    its QNN contexts, weights included) plus every tensor that each method reads and writes, at its dtype and
    shape (the KV caches the session holds, the masks, the logits, the new K/V). Not counted: the runtime's own
    libraries and the interpreter (the same for every variant), and QNN's scratch memory inside a call. What
    grows with the context is the caches and masks, counted here, so the estimate ranks one model's contexts."""
    tensors = sum(
        int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
        for method in manifest.contract.methods for t in (*method.inputs, *method.outputs)
    )
    return manifest.program.size + tensors


@dataclass(frozen=True)
class MemoryFit:
    """Chooses among variants that differ only in context: the largest whose `memory_need_bytes` fits the budget,
    or the smallest with a warning when none fits.

    ``need_bytes(entry)`` reads the entry's manifest (from the folder, or from the Hub). The budget is ``max_memory``
    GB when given, else what this host has available less the margin the exporter keeps too
    (`host_memory.default_budget_gib`), read only when there is a choice to make."""

    need_bytes: Callable[[dict[str, Any]], int]
    max_memory: float | None = None

    def budget(self) -> tuple[float | None, str]:
        """The budget in GB (None: unknown) and where it comes from."""
        if self.max_memory is not None:
            return self.max_memory, "max_memory"
        available, source = available_memory()
        return default_budget_gib(available), f"{source}, less a margin"

    def choose(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        ordered = sorted(entries, key=lambda v: v["context_len"], reverse=True)
        contexts = ", ".join(str(v["context_len"]) for v in ordered)  # one variant per context (`select_variant`)
        budget_gib, source = self.budget()
        if budget_gib is None:
            notice.info("Context %d: the largest of this artifact's (%s); this host's memory is unknown, "
                        "choose another with --max-seq-len", ordered[0]["context_len"], contexts)
            return ordered[0]
        for entry in ordered:
            need = self.need_bytes(entry)
            if need <= budget_gib * GB_BYTES:
                notice.info("Context %d: the largest of this artifact's (%s) whose estimated %s fits %.2f GB (%s); "
                            "choose another with --max-seq-len", entry["context_len"], contexts, _size(need),
                            budget_gib, source)
                return entry
        smallest = ordered[-1]
        logger.warning("No context of this artifact (%s) fits %.2f GB (%s): taking the smallest, %d, which needs an "
                       "estimated %s", contexts, budget_gib, source, smallest["context_len"],
                       _size(self.need_bytes(smallest)))
        return smallest


def _size(n: int) -> str:
    return f"{n / GB_BYTES:.2f} GB" if n >= GB_BYTES // 10 else f"{n / 2**20:.1f} MB"


def verify_files(
    folder: Path, manifest: Manifest, *, root: Path | None = None, allowed_root: Path | None = None
) -> None:
    """Check the size and sha256 of every file the manifest lists; a mismatch names the file.

    ``folder`` is the variant folder; ``root``, when given, is the artifact root whose shared files (config,
    tokenizer...) the manifest's ``root_files`` list: they are checked too, since a tampered tokenizer or config
    changes what the model generates as surely as a tampered program. A 1.0 manifest lists no root files.
    ``allowed_root``: see `resolve_inside` (the blobs folder of a Hugging Face cache snapshot).
    """
    checks = [(folder, entry) for entry in manifest.files]
    if root is not None and manifest.root_files is not None:
        checks += [(root, entry) for entry in manifest.root_files]
    elif root is not None:
        logger.info("%s: a schema %s manifest lists no root files; config and tokenizer are not verified",
                    folder, manifest.schema_version)
    for base, entry in checks:
        path = resolve_inside(base, entry.path, allowed_root=allowed_root)
        if not path.is_file():
            raise ManifestError(f"{entry.path} is listed in the manifest but missing from {base}")
        if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            raise ManifestError(
                f"{entry.path} does not match its manifest sha256 (corrupt or tampered file at {path}); "
                "delete it and download or export it again"
            )
