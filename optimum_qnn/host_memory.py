"""The memory this host has: what a process can still take (the machine's MemAvailable, or a control group's limit
when that leaves less), the margin held back from it, and the ``--max-memory GB`` that replaces it.

Core, not exporter: the exporter sizes its shards against this budget (`exporter.memory`), and the runtime chooses
the largest exported context that fits it (`artifacts.variants.MemoryFit`). GB here is 2**30 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from optimum_qnn.errors import InvalidInputError

GB_BYTES = 2**30
# Held back from MemAvailable when the user gives no --max-memory: other processes grow, and an estimate is a fit.
MARGIN_FRACTION, MIN_MARGIN_GB = 0.10, 1.0


@dataclass(frozen=True)
class CgroupFiles:
    """Where this process's control groups are described (`/proc/self/cgroup`) and mounted."""

    membership: Path = Path("/proc/self/cgroup")
    root: Path = Path("/sys/fs/cgroup")


def available_memory(meminfo: Path = Path("/proc/meminfo"), cgroups: CgroupFiles | None = None) -> tuple[float | None, str]:
    """The memory this process can still take, in GB, and what limits it: the machine's MemAvailable, or the
    memory limit of a control group it runs in (a container, a systemd slice, a CI job) when that leaves less.
    (None, "unknown") where neither is reported."""
    machine = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                machine = int(line.split()[1]) * 1024 / GB_BYTES
                break
    except (OSError, ValueError, IndexError):
        pass
    group = _cgroup_headroom(cgroups or CgroupFiles())
    if group is not None and (machine is None or group < machine):
        return group, f"cgroup memory limit, {group:.1f} GB free"
    return machine, "unknown" if machine is None else f"MemAvailable {machine:.1f} GB"


def _cgroup_headroom(files: CgroupFiles) -> float | None:
    """The smallest headroom over the memory cgroups this process belongs to and their ancestors, in GB; None
    without a limit. Headroom: the limit less the usage, plus the group's clean file cache (active and inactive),
    which the kernel reclaims before it kills, as MemAvailable counts a machine's page cache. Counting the inactive
    part alone, the compile gate of a full-size Gemma-4-E2B lowering in a 16 GB cgroup (--shards 4) saw 4020 MiB
    where the budget left 8035, and compiled the lm_head's shard alone for 159 s: the export's own file mappings (the
    quantized weights, the tables) and the checkpoint it read stay on the active list while they are in use."""
    try:
        membership = files.membership.read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in membership:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2 (unified hierarchy), mounted at the root or under "unified"
            base = files.root if (files.root / "cgroup.controllers").exists() else files.root / "unified"
            limit_name, usage_name = "memory.max", "memory.current"
            cache_names, unclean_names = ("active_file", "inactive_file"), ("file_dirty", "file_writeback")
        elif "memory" in controllers.split(","):  # cgroup v1
            base = files.root / "memory"
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache_names, unclean_names = ("total_active_file", "total_inactive_file"), ("total_dirty", "total_writeback")
        else:
            continue
        folder = base / path.strip().lstrip("/")
        while True:
            try:
                limit = (folder / limit_name).read_text().strip()
                if limit != "max" and int(limit) < 1 << 60:  # v1 says "no limit" with a huge number
                    usage = int((folder / usage_name).read_text())
                    stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
                    cache = sum(int(stat.get(name, 0)) for name in cache_names)
                    clean = max(0, cache - sum(int(stat.get(name, 0)) for name in unclean_names))
                    headrooms.append((int(limit) - usage + clean) / GB_BYTES)
            except (OSError, ValueError):
                pass
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return max(0.0, min(headrooms)) if headrooms else None


def default_budget_gib(available: float | None) -> float | None:
    """The budget when the user sets none: what is available, less a margin (10 %, at least 1 GB)."""
    if available is None:
        return None
    return max(0.0, available - max(MIN_MARGIN_GB, MARGIN_FRACTION * available))


def parse_max_memory(text: str | float) -> float:
    """``--max-memory GB``: a positive number of GB."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(text, bool) or not math.isfinite(value) or value <= 0:
        raise InvalidInputError(f"--max-memory must be a positive number of GB, e.g. 16 or 7.5; got {text!r}")
    return value
