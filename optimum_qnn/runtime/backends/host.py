"""The in-process backends: a variant's graphs run in this process, driven token by token through the runner
contract (`session.KVSession`): `ExecuTorchBackend` (the .pte in ExecuTorch's Python runtime) and, in
`runtime/backends/onnxruntime/`, the same contexts in onnxruntime-qnn. Both share `InProcessBackend`'s generation
logic, so they cannot differ in what they do with the caches, the stops or the sampling.

The caches outlive a call: ``held`` lists the tokens whose K/V they hold, and a call with ``reuse_cache=True``
whose prompt begins with some of them keeps those slots and prefills only the rest (a conversation's next turn, or
a client that sends the whole history each time). The match may end anywhere, also inside what one prefill call
wrote: `KVSession.truncate` forgets the slots after it.

One call at a time: the caches, ``held`` and the programs' IO buffers are the backend's own, so calls from several
threads take turns on ``lock`` (interleaved, they would read each other's K/V and give wrong tokens silently).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from optimum_qnn.artifacts.manifest import Manifest, resolve_inside
from optimum_qnn.errors import ContextOverflowError
from optimum_qnn.lookahead import lookahead_of
from optimum_qnn.runtime.assistant import AssistantDecoder, assistant_of
from optimum_qnn.runtime.generation import GenerationStats, Sampling, common_prefix, eos_ids
from optimum_qnn.runtime.lookahead import LookaheadDecoder
from optimum_qnn.session import KVSession, MethodFn, SoftTokens

logger = logging.getLogger(__name__)


class InProcessBackend:
    """Generates through ``methods`` (method name -> callable in runner-contract order), keeping the caches
    between calls. ``clock.total`` must grow by the seconds each method call spends in its runtime."""

    runtime = ""  # the subclass's: "executorch" or "onnxruntime"
    streams = True  # the streamer gets each token as it is generated
    runs_assistant = True  # decodes with a variant's drafter (speculative="assistant"); a C++ runner cannot
    applies_logits = True  # sees each row of logits: `sampling.pick` may apply any rule (transformers' processors)
    takes_images = True  # feeds an image variant's soft tokens to its prefill method

    @property
    def name(self) -> str:
        """Where the tokens are computed, as a device name: ``host:executorch`` or ``host:onnxruntime``."""
        return f"host:{self.runtime}"

    def __init__(self, manifest: Manifest, methods: dict[str, MethodFn], clock: Any):
        self.manifest = manifest
        self.contract = manifest.runner_contract()
        self.stats = GenerationStats()
        self.clock = clock
        self.session = KVSession(self.contract, methods)
        self.held: list[int] = []  # the tokens whose K/V the caches hold, slots [0, len(held))
        self.lookahead = lookahead_of(manifest)
        self.assistant = assistant_of(manifest)
        self.lock = threading.RLock()  # one generation (or image encoding) at a time: see the module's docstring

    def clear_cache(self) -> None:
        """Forget what the caches hold: the next call prefills its whole prompt even with ``reuse_cache=True``."""
        with self.lock:
            self.held = []
            self.session.reset()

    def generate(self, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling, eos_token_id: Any,
                 streamer: Any, *, reuse_cache: bool = False, cancel: Any = None,
                 speculative: str | None = None, images: SoftTokens | None = None) -> list[int]:
        """The new tokens after ``prompt`` (1-D ids, checked by the caller); fills ``self.stats``.

        ``reuse_cache``: keep the K/V of the longest prefix of ``prompt`` the caches hold (at least one prompt token
        is always fed, for its logits). ``cancel``: called before each decode step; True stops the reply there.
        ``speculative="lookahead"``: decode with lookahead decoding (`runtime.lookahead`); ``"assistant"``: with
        the variant's drafter (`runtime.assistant`). Both checked by the caller. ``images``: soft tokens among
        ``prompt`` (an image variant's; ``prompt`` holds the pad id at their places); a soft token matches a held one
        only if its embedding is the same, so a conversation's later turns reuse an image's K/V.
        """
        with self.lock:
            return self._generate(prompt, max_new_tokens, sampling, eos_token_id, streamer, reuse_cache=reuse_cache,
                                  cancel=cancel, speculative=speculative, images=images)

    def _generate(self, prompt: np.ndarray, max_new_tokens: int, sampling: Sampling, eos_token_id: Any,
                  streamer: Any, *, reuse_cache: bool, cancel: Any, speculative: str | None,
                  images: SoftTokens | None) -> list[int]:
        session = self.session
        capacity = session.capacity
        if prompt.size > capacity:
            raise ContextOverflowError(
                f"The prompt has {prompt.size} tokens but the exported context holds {capacity}; "
                "shorten it or export with a larger --max-seq-len"
            )
        eos = eos_ids(eos_token_id, default=self.manifest.tokenizer.eos_ids)
        ids = prompt.tolist()
        keys = ids if images is None else image_keys(ids, images)  # what `held` remembers of each position
        reused = min(common_prefix(self.held, keys), len(ids) - 1) if reuse_cache else 0
        self.held = []  # until this call ends cleanly, the caches hold nothing it can vouch for
        if reused:  # held never outgrows the stored slots
            session.truncate(reused)
        else:
            session.reset()
        stats = GenerationStats(prompt_tokens=len(ids), reused_tokens=reused, prefilled_tokens=len(ids) - reused,
                                stopped_by="max_new_tokens")
        self.clock.total = 0.0
        t0 = time.perf_counter()
        logits = session.feed(prompt[reused:], None if images is None else images.rows(reused, len(ids)))[-1]
        stats.time_to_first_token_s = time.perf_counter() - t0
        stats.prefill_tokens_per_s = stats.prefilled_tokens / max(stats.time_to_first_token_s, 1e-9)
        new: list[int] = []
        decode_exec = 0.0
        if speculative == "lookahead":
            decoder = LookaheadDecoder(session, self.lookahead, prompt, sampling)
            step = lambda token, limit: decoder.step(token, limit, eos)  # noqa: E731
        elif speculative == "assistant":
            decoder = AssistantDecoder(session, self.assistant, session.methods[self.assistant.method], sampling)
            step = lambda token, limit: decoder.step(token, limit, eos)  # noqa: E731
        else:
            step = lambda token, limit: [sampling.pick(session.feed(np.array([token]))[-1])]  # noqa: E731
        pending = [sampling.pick(logits)] if max_new_tokens else []
        while pending:
            for token in pending:
                new.append(token)
                if streamer is not None:
                    streamer.put(np.array([token]))
            if new[-1] in eos:
                stats.stopped_by = "eos"
                break
            if len(new) >= max_new_tokens:
                break
            if cancel is not None and cancel():
                stats.stopped_by = "cancelled"
                break
            if session.n_past >= capacity:
                stats.stopped_by = "context_full"
                logger.warning("Generation stopped: the exported context of %d tokens is full", capacity)
                break
            before = self.clock.total
            s0 = time.perf_counter()
            pending = step(new[-1], max_new_tokens - len(new))
            stats.step_times.append(time.perf_counter() - s0)
            stats.decode_tokens += len(pending)
            decode_exec += self.clock.total - before
        if speculative is not None:
            stats.speculative = speculative
            stats.drafted_tokens, stats.accepted_tokens = decoder.drafted, decoder.accepted
            stats.drafter_calls = getattr(decoder, "drafter_calls", 0)
        stats.new_tokens = len(new)
        self.held = (keys + new)[: session.stored]  # the last new token was never fed: stored <= len(ids + new) - 1
        decode_time = sum(stats.step_times)
        if stats.step_times:
            stats.decode_tokens_per_s = stats.decode_tokens / decode_time
            stats.host_overhead_share = max(0.0, 1.0 - decode_exec / decode_time)
        self.stats = stats
        return new


def image_keys(ids: list[int], images: SoftTokens) -> list:
    """``ids`` with each soft token's place holding a digest of its embedding instead of the pad id: two prompts share
    a prefix only where they hold the same image."""
    import hashlib

    keys: list = list(ids)
    for i in np.flatnonzero(images.mask):
        keys[i] = ("image", hashlib.blake2b(images.embeds[i].tobytes(), digest_size=16).hexdigest())
    return keys


class ExecuTorchBackend(InProcessBackend):
    """The variant's .pte in ExecuTorch's Python runtime here (a Snapdragon host's HTP, or the x86 HTP emulator).
    ``program`` is the shared loaded .pte (`program.LoadedProgram`)."""

    runtime = "executorch"

    def __init__(self, variant: Path, manifest: Manifest, *, allowed_root: Path | None = None):
        from optimum_qnn.artifacts.inspection import program_load_bytes
        from optimum_qnn.program import ExecClock, LoadedProgram, ProgramFacts, TimedMethod

        pte = resolve_inside(variant, manifest.program.path, allowed_root=allowed_root)
        self.program = LoadedProgram.get(pte, ProgramFacts.of(manifest), load_bytes=lambda: program_load_bytes(pte))
        clock = ExecClock()
        contract = manifest.runner_contract()
        super().__init__(manifest, {m.name: TimedMethod(self.program, m.name, clock) for m in contract.methods}, clock)


HostBackend = ExecuTorchBackend  # the name earlier releases gave it
