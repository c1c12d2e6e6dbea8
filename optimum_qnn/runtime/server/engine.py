"""One generation at a time on the NPU, a bounded queue behind it.

Requests come from the server's event loop; the model runs on one worker thread (the HTP, or its emulator, takes one
call at a time and the host backend's caches belong to one conversation). Every generation asks the host backend to
reuse the longest prefix it holds (`generate(..., reuse_cache=True)`), so a client that sends the whole history each
turn prefills only the new tokens. A job's text comes out as it is decoded, held back where it could still turn into
a stop string, and a job can be cancelled (its client went away, or the server stops) at the next token.

A backend that fails does not take the worker down: the job keeps the exception (``job.error``, finish reason
``error``), logged here once, and the server turns it into an OpenAI-shaped error (`app.api_error`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from optimum_qnn.errors import OptimumQnnError
from optimum_qnn.runtime.text_stream import TextStream

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot (the running generation and the queue behind it) is taken."""


@dataclass
class Job:
    """One generation: its prompt ids, its `generate` options and stop strings, and what it produced."""

    ids: list[int]
    options: dict[str, Any]
    stop: list[str] = field(default_factory=list)
    images: dict[str, Any] | None = None  # the prompt's images' processed inputs, encoded on the worker
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: Any = None
    error: BaseException | None = None  # what the backend raised (finish_reason "error")
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Filled by `Engine.submit`: where text pieces go as they come (None marks the end).
    pieces: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def cancel(self) -> None:
        self.cancelled.set()


class _JobStreamer:
    """The `generate` streamer of a job: decodes as tokens come (`TextStream`), sends the text that no stop string can
    still claim, and stops the generation at a stop string."""

    def __init__(self, job: Job, tokenizer: Any):
        self.job, self.stream = job, TextStream(tokenizer)
        self.hold = max((len(s) for s in job.stop), default=0)

    def put(self, value: Any) -> None:
        job = self.job
        if job.finish_reason == "stop":
            return
        ids = value.reshape(-1).tolist()
        job.tokens += ids
        self.stream.add(ids)
        text = self.stream.text
        cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
        if cut >= 0:
            job.text, job.finish_reason = text[:cut], "stop"
            job.cancel()  # stop at the next token
            self._send(self.stream.take(cut))
            return
        job.text = text
        stable = len(self.stream.stable)
        self._send(self.stream.take(stable - self.hold + 1 if self.hold else stable))

    def _send(self, piece: str) -> None:
        if piece:
            self.job.loop.call_soon_threadsafe(self.job.pieces.put_nowait, piece)

    def end(self) -> None:
        self._send(self.stream.take(len(self.job.text)))


class Engine:
    """Runs jobs one at a time; ``queue_size`` more may wait. `submit` raises `QueueFull` when all slots are taken."""

    def __init__(self, model: Any, tokenizer: Any, *, queue_size: int = 8):
        self.model, self.tokenizer, self.queue_size = model, tokenizer, queue_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optimum-qnn-npu")
        self._lock = threading.Lock()
        self._jobs: list[Job] = []  # running and waiting
        self.last: dict[str, Any] | None = None  # what the last finished generation did (the health endpoint shows it)
        self.mean_seconds = 5.0  # a running estimate of a generation's length, for Retry-After

    @property
    def busy(self) -> int:
        with self._lock:
            return len(self._jobs)

    def submit(self, job: Job) -> asyncio.Future:
        """Queue ``job``; returns a future that completes when it is done. Its text pieces go to ``job.pieces``."""
        with self._lock:
            if len(self._jobs) >= 1 + self.queue_size:
                raise QueueFull
            self._jobs.append(job)
        job.loop = asyncio.get_running_loop()
        job.pieces = asyncio.Queue()
        return asyncio.wrap_future(self._pool.submit(self._run, job))

    def retry_after(self) -> int:
        """Seconds until a slot is likely free (at least 1)."""
        return max(1, round(self.mean_seconds * max(1, self.busy - self.queue_size)))

    def _run(self, job: Job) -> Job:
        t0 = time.perf_counter()
        try:
            if job.cancelled.is_set():  # its client left while it waited
                job.finish_reason = "cancelled"
                return job
            streamer = _JobStreamer(job, self.tokenizer)
            try:
                speculative = getattr(self.model, "default_speculative", None)  # lookahead when exported for it
                options = {**({"speculative": speculative} if speculative else {}), **job.options}
                if job.images is not None:  # on the worker: the vision encoder runs where the decoder runs
                    options["image_features"] = self.model.encode_images(job.images["pixel_values"],
                                                                         job.images["image_position_ids"])
                self.model.generate_tokens(job.ids, streamer=streamer, cancel=job.cancelled.is_set, reuse_cache=True,
                                    **options)
            except Exception as e:  # the worker outlives a failing backend; the server answers with the error
                job.error, job.finish_reason = e, "error"
                if isinstance(e, OptimumQnnError):
                    logger.warning("The generation failed: %s", e)
                else:
                    logger.exception("The backend failed unexpectedly")
                return job
            s = job.stats = self.model.stats
            if job.finish_reason is None:
                job.finish_reason = {"eos": "stop", "cancelled": "cancelled"}.get(s.stopped_by, "length")
            self.last = {
                "prompt_tokens": s.prompt_tokens, "cached_tokens": s.reused_tokens, "completion_tokens": len(job.tokens),
                "stopped_by": job.finish_reason if job.finish_reason == "stop" else s.stopped_by,
                "time_to_first_token_s": round(s.time_to_first_token_s, 4),
                "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
            }
            logger.info(
                "%d prompt tokens (%d cached) + %d new, %s | first token %.2f s | decode %.1f tok/s",
                s.prompt_tokens, s.reused_tokens, len(job.tokens), self.last["stopped_by"],
                s.time_to_first_token_s, s.decode_tokens_per_s,
            )
            return job
        finally:
            self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * (time.perf_counter() - t0)
            with self._lock:
                self._jobs.remove(job)
            job.loop.call_soon_threadsafe(job.pieces.put_nowait, None)

    def cancel_all(self) -> None:
        """Stop the running job at its next token and drop the waiting ones (the server is stopping)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()

    def close(self) -> None:
        self.cancel_all()
        self._pool.shutdown(wait=True)
