"""Lower several SoCs of one export side by side: each SoC's lowering in its own forked child, up to two per core
and as many as the memory budget allows.

Why: after the SoC-independent part (`EdgeLowering.prepare`), a SoC's lowering is the QNN op check, the
partitioning, the compile and the serialization, and for a model of one shard most of it runs on one core (the
compile holds the GIL and is one thread). Measured on Gemma-4-E2B's widths at 2 layers (16a8w, `benchmarks/multi_soc.py`,
one after the other): every extra SoC cost 0.63-0.93x of the first SoC's whole export, 73 s of it one QNN compile. Two
lowerings side by side use both cores of a 2-core machine.

Up to two lowerings per core run at once (memory permitting), not one: with one per core, SoCs beyond a multiple of the
cores lower in a wave of their own and leave cores idle (at E2B widths, 2 layers, 2 cores: the third SoC of three cost
0.73x of the first export, lowering alone after the first two), and the lowerings of one wave differ in length (SM8850's
compile is the slowest), so the shorter ones' cores idle until the longest ends. With more lowerings than cores the
kernel shares the cores among them: the same CPU work, no idle core. Each lowering's shard compiles get the cores left
per lowering (at least one worker).

Each child lowers its copy-on-write copy of the edge programs, exactly as the one-after-the-other path does
(`EdgeLowering.lower(keep=True)`), so every SoC still gets the program a single-SoC export makes. The SoCs go in waves
as even as they can be (`wave_sizes`); a wave's variants are written when the whole wave is lowered, in the order the SoCs
were given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ContextManager

from optimum_qnn.config import Soc
from optimum_qnn.environment import OFF, ON, switch_value
from optimum_qnn.errors import InvalidInputError
from optimum_qnn.exporter.lowering import EdgeLowering, LoweredProgram
from optimum_qnn.exporter.parallel_compile import default_workers, fork_available
from optimum_qnn.progress import side_by_side_progress

logger = logging.getLogger(__name__)

# OPTIMUM_QNN_SOCS_SIDE_BY_SIDE=off lowers one SoC after the other, on (the default) as many at once as the cores and
# memory allow, a whole number N >= 2 at most N at once (`socs_cap`).
SOCS_SIDE_BY_SIDE_VARIABLE = "OPTIMUM_QNN_SOCS_SIDE_BY_SIDE"
_POLL_SECONDS = 0.1
LOWERINGS_PER_CORE = 2  # at most this many SoC lowerings per core at once (see the module's docstring)


def socs_at_once(socs: int, lowering_gb: float, budget_gb: float | None, *, cores: int | None = None,
                 variable: str | None = None) -> int:
    """How many SoC lowerings run at once: one per SoC, at most `LOWERINGS_PER_CORE` per core, and only as many as
    whole lowerings (``lowering_gb``: the memory plan's estimate of the lower stage, this process included, so counted
    in full each time) fit in the budget. 1 where fork is unavailable or the budget is unknown; ``variable`` (the
    environment's OPTIMUM_QNN_SOCS_SIDE_BY_SIDE, `socs_cap`) caps it."""
    if socs < 2 or budget_gb is None or lowering_gb <= 0 or not fork_available():
        return 1
    cores = default_workers() if cores is None else cores
    at_once = min(socs, LOWERINGS_PER_CORE * cores, int(budget_gb // lowering_gb))
    text = os.environ.get(SOCS_SIDE_BY_SIDE_VARIABLE) if variable is None else variable
    at_once = min(at_once, socs_cap(text))
    return max(1, at_once)


def socs_cap(text: str | None) -> int:
    """The cap OPTIMUM_QNN_SOCS_SIDE_BY_SIDE sets: an on/off switch spelled as every switch is
    (`environment.switch_value`; off: one at a time, on or unset: no cap), or a whole number >= 2 (at most that many)."""
    if text is not None and text.strip().isdigit() and int(text) >= 2:
        return int(text)
    try:
        return 1_000_000 if switch_value(SOCS_SIDE_BY_SIDE_VARIABLE, text, True) else 1
    except InvalidInputError:
        raise InvalidInputError(
            f"{SOCS_SIDE_BY_SIDE_VARIABLE}={text!r}: expected off (one SoC after the other: {', '.join(OFF)}), on "
            f"(as many as the cores and memory allow: {', '.join(ON)}) or a whole number >= 2 (at most that many)"
        ) from None


def wave_sizes(socs: int, at_once: int) -> list[int]:
    """The fewest waves of at most ``at_once`` SoCs, as even as they can be (larger first): 4 SoCs, 3 at once make
    2 + 2, not 3 + 1. A lowering alone in the last wave runs on one core while the others idle (measured at E2B widths,
    2 layers, 2 cores, 3 at once: SM8850 lowered alone for 120 s after a wave of three, 263 s of lowering for four SoCs
    where two waves of two took 209 s at dfe0ea5)."""
    waves = -(-socs // max(1, at_once))
    base, extra = divmod(socs, waves) if waves else (0, 0)
    return [base + 1] * extra + [base] * (waves - extra)


def lower_side_by_side(
    lowering: EdgeLowering,
    socs: Sequence[Soc],
    at_once: int,
    *,
    weight_sharing: bool,
    budget_gb: float | None,
    program_file: Callable[[], Path],
    lowered: Callable[[list[tuple[Soc, LoweredProgram, float]]], None],
    stage: Callable[[str], ContextManager] = contextlib.nullcontext,
    rss_mb: Callable[[], float] | None = None,
) -> None:
    """Lower ``socs`` in waves of at most ``at_once`` forked children (`wave_sizes`), each wave inside
    ``stage("lower A+B")``. After each wave, ``lowered(wave)`` gets (SoC, program, seconds its own lowering took) in
    the order of ``socs``; it writes the variants. ``program_file()`` gives a fresh staging path for each SoC's .pte
    (deleted here if the wave fails).

    Each child compiles its shards with the cores per lowering of its wave (at least 1 worker) within the budget per
    lowering of its wave: a last wave of fewer SoCs gets more of each.

    Raises:
        whatever a lowering raised; the other lowerings of its wave are stopped and their files removed.
    """
    cores = default_workers()
    first = 0
    for size in wave_sizes(len(socs), at_once):
        wave = list(socs[first:first + size])
        first += size
        workers = max(1, cores // len(wave))
        share = None if budget_gb is None else budget_gb / len(wave)
        t0 = time.perf_counter()
        started = []
        results: dict[Soc, tuple[LoweredProgram, float]] = {}
        if len(wave) > 1:
            logger.info("Lowering %s side by side", ", ".join(soc.value for soc in wave))
        with stage("lower " + "+".join(soc.value for soc in wave)), \
                side_by_side_progress([f"Lowering for {wave[0].value}", *(soc.value for soc in wave[1:])], rss_mb) as parts:
            try:
                for soc, part in zip(wave, parts):
                    path = program_file()
                    started.append((soc, path, part, lowering.lower_forked(
                        soc, weight_sharing=weight_sharing, workers=workers, memory_budget_gb=share, path=path,
                        records=part,
                    )))
                waiting = list(started)
                while waiting:
                    for item in [item for item in waiting if item[3].finished()]:
                        soc, _, part, forked = item
                        waiting.remove(item)
                        results[soc] = (forked.result(), time.perf_counter() - t0)
                        part.finish()
                    time.sleep(_POLL_SECONDS)
            except BaseException:
                for _, path, _, forked in started:
                    forked.cancel()
                    path.unlink(missing_ok=True)
                raise
        lowered([(soc, *results[soc]) for soc in wave])
