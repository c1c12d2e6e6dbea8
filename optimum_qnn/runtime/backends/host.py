"""The host backend: the .pte in ExecuTorch's Python runtime in this process (a Snapdragon host's HTP, or the x86
HTP emulator), driven token by token through the runner contract (`session.KVSession`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from optimum_qnn.artifacts.manifest import Manifest, resolve_inside
from optimum_qnn.errors import ContextOverflowError
from optimum_qnn.program import ExecClock, LoadedProgram, ProgramFacts, TimedMethod
from optimum_qnn.runtime.generation import GenerationStats, Sampling, eos_ids
from optimum_qnn.session import KVSession

logger = logging.getLogger(__name__)


class HostBackend:
    """Runs one variant here. ``program`` is the shared loaded .pte, ``session`` its KV session (tokens stream out
    as they are generated)."""

    name = "host"
    streams = True  # the streamer gets each token as it is generated

    def __init__(self, variant: Path, manifest: Manifest, *, allowed_root: Path | None = None):
        self.manifest = manifest
        self.contract = manifest.runner_contract()
        self.stats = GenerationStats()
        pte = resolve_inside(variant, manifest.program.path, allowed_root=allowed_root)
        self.program = LoadedProgram.get(pte, ProgramFacts.of(manifest))
        self.clock = ExecClock()
        timed = {m.name: TimedMethod(self.program, m.name, self.clock) for m in self.contract.methods}
        self.session = KVSession(self.contract, timed)

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling, eos_token_id: Any,
                 streamer: Any) -> list[int]:
        """The new tokens after ``prompt`` (1-D ids, checked by the caller); fills ``self.stats``."""
        session = self.session
        capacity = session.capacity
        if prompt.numel() > capacity:
            raise ContextOverflowError(
                f"The prompt has {prompt.numel()} tokens but the exported context holds {capacity}; "
                "shorten it or export with a larger --max-seq-len"
            )
        eos = eos_ids(eos_token_id, default=self.manifest.tokenizer.eos_ids)
        session.reset()
        stats = GenerationStats(prompt_tokens=prompt.numel(), stopped_by="max_new_tokens")
        self.clock.total = 0.0
        t0 = time.perf_counter()
        logits = session.feed(prompt)[-1]
        stats.time_to_first_token_s = time.perf_counter() - t0
        stats.prefill_tokens_per_s = prompt.numel() / max(stats.time_to_first_token_s, 1e-9)
        new: list[int] = []
        decode_exec = 0.0
        for step in range(max_new_tokens):
            token = sampling.pick(logits)
            new.append(token)
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            if token in eos:
                stats.stopped_by = "eos"
                break
            if step == max_new_tokens - 1:
                break
            if session.n_past >= capacity:
                stats.stopped_by = "context_full"
                logger.warning("Generation stopped: the exported context of %d tokens is full", capacity)
                break
            before = self.clock.total
            s0 = time.perf_counter()
            logits = session.feed(torch.tensor([token]))[-1]
            stats.step_times.append(time.perf_counter() - s0)
            decode_exec += self.clock.total - before
        stats.new_tokens = len(new)
        decode_time = sum(stats.step_times)
        if stats.step_times:
            stats.decode_tokens_per_s = len(stats.step_times) / decode_time
            stats.host_overhead_share = max(0.0, 1.0 - decode_exec / decode_time)
        self.stats = stats
        return new
