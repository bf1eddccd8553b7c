"""How a sweep's cells are cut into batches for `dpfedavg.engines.batched_runs`, within a memory budget.

Cells with equal `batch_key()` form a group; a group is cut into batches
of consecutive cells (grid order) of at most `MAX_RUNS_PER_BATCH` runs and at most as many as the
memory budget holds (`batch_bytes()`). The cut depends on the grid and the budget only, never on
``--jobs`` or on where the batches run (local processes or a Ray cluster), so a sweep gives the same
numbers however it is executed. A cell that cannot join a batch runs alone, and the plan says why.

The budget is ``--max-batch-memory`` (``run_sim.py``; bytes, or a size such as ``512MiB`` / ``2G``), or by
default half the memory available now, shared by the ``jobs`` batches that run at once
(`default_budget()`). A budget below one run's need is refused with the minimum
(`BatchMemoryError`).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dpfedavg.config import RunConfig
from dpfedavg.engines.batched import BLOCK_ELEMENTS
from dpfedavg.tasks.base import task_hooks

if TYPE_CHECKING:
    from dpfedavg.tasks import Task

__all__ = [
    "MAX_RUNS_PER_BATCH",
    "BatchMemoryError",
    "BatchPlan",
    "available_memory",
    "batch_bytes",
    "default_budget",
    "format_bytes",
    "parse_memory",
    "plan_batches",
]

logger = logging.getLogger(__name__)

#: At most this many runs per batch: enough to share the clients' data and noise draws and to amortize
#: the per-round work (the paper's grid keeps a seed's 36 runs, 3 C x 2 inits x 3 eta x clip/norm, in one
#: batch: cut in two, both halves drew every client's noise and ran the round's Python, 20 % more CPU time);
#: small enough that a grid gives a few batches per CPU to balance.
MAX_RUNS_PER_BATCH = 36
#: Bytes per round a run keeps in memory (its round statistics, evaluated metrics): measured about 1 KiB.
HISTORY_BYTES_PER_ROUND = 1536
#: float64 arrays of a (run, client) row alive at once in a block, at most: u, its squares (the norms' pass), a
#: masked copy of u when a client diverged, the shared draws (the sums need no g or noisy rows: core.runs).
ROW_ARRAYS = 4

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}  # fmt: skip


class BatchMemoryError(ValueError):
    """The memory budget cannot hold one run of the grid (the message gives the minimum)."""


def parse_memory(text: str | int | float, flag: str = "--max-batch-memory") -> int:
    """Bytes from ``2G``, ``512MiB``, ``1.5GB``, ``300M`` or a plain number of bytes; ``ValueError`` naming ``flag``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"{flag} = {text!r}: expected a size > 0 such as 2G, 512MiB, 1.5GB or a number of bytes "
            "(units: K, M, G, T in powers of 1000, KiB, MiB, GiB, TiB in powers of 1024)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``n`` bytes as ``12.3 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def available_memory() -> int:
    """Bytes of memory available now (psutil when installed, else ``/proc/meminfo`` or the physical pages)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def default_budget(jobs: int = 1) -> int:
    """Half the memory available now, shared by the ``jobs`` batches that run at the same time."""
    return available_memory() // (2 * max(1, jobs))


def batch_bytes(cfg: RunConfig, dim: int, runs: int, shared_bytes: int = 0) -> int:
    """An estimate of the peak memory of a batch of ``runs`` runs like ``cfg`` on a model of ``dim`` parameters.

    Per run: its state (``w``, momentum, random iterate and the round's copies), its trajectory
    (``save-trajectory``: ``K + 1`` float32 vectors) and its round history; per block of clients, the
    engine's `ROW_ARRAYS` float64 rows per (run, client), the block holding at most
    ``BLOCK_ELEMENTS`` of them (one client at least); plus the task's data shared by the batch.
    """
    release = dim + 1
    per_run = 8 * 8 * release + HISTORY_BYTES_PER_ROUND * cfg.num_rounds
    if cfg.save_trajectory:
        per_run += 4 * dim * (cfg.num_rounds + 1)
    clients = max(1, min(cfg.num_clients, math.ceil(cfg.clients_per_round)))
    block = max(1, min(clients, BLOCK_ELEMENTS // max(1, runs * release)))
    working = 8 * ROW_ARRAYS * runs * release * block
    return runs * per_run + working + shared_bytes


def _shared_bytes(task: Task) -> int:
    """What the task keeps for the whole batch (the task's own estimate, ``batch_shared_bytes``; else 0)."""
    return task_hooks(task).batch_shared_bytes


@dataclass
class BatchPlan:
    """The cells cut into batches, and the cells that run alone with the reason."""

    batches: list[list] = field(default_factory=list)
    alone: list[tuple] = field(default_factory=list)  # (cell, reason)

    @property
    def work(self) -> list[list]:
        """Every unit of work: each batch, then each lone cell as a list of one."""
        return self.batches + [[cell] for cell, _ in self.alone]


def _cfg(item) -> RunConfig:
    return item.cfg if hasattr(item, "cfg") else item


def plan_batches(
    cells: Sequence,
    *,
    max_memory: int | None = None,
    max_runs: int = MAX_RUNS_PER_BATCH,
    strict: bool = True,
) -> BatchPlan:
    """Cut ``cells`` (sweep cells or configs) into batches (see the module docstring).

    ``max_memory`` bounds each batch's `batch_bytes()` (``None``: no bound). With ``strict = False``
    (a default budget rather than the user's) a budget below one run gives batches of one run instead
    of an error.

    Raises
    ------
    BatchMemoryError
        When ``max_memory`` cannot hold one run of some group (the message gives the minimum).
    """
    from dpfedavg.engines.batched_runs import batch_key, task_reason, unbatchable_reason
    from dpfedavg.tasks import build_task

    plan = BatchPlan()
    groups: dict[tuple, list] = {}
    tasks: dict[tuple, Task] = {}
    for item in cells:
        cfg = _cfg(item)
        reason = unbatchable_reason(cfg)
        if reason is not None:
            plan.alone.append((item, reason))
            continue
        # one task per distinct configuration outside the engine's run axis (building one is cheap)
        outer = batch_key(cfg)
        if outer not in tasks:
            tasks[outer] = build_task(cfg)
        task = tasks[outer]
        reason = task_reason(task)
        if reason is not None:
            plan.alone.append((item, reason))
            continue
        groups.setdefault(batch_key(cfg, task), []).append((item, task))
    for members in groups.values():
        cfg, task = _cfg(members[0][0]), members[0][1]
        dim, shared = task.dim, _shared_bytes(task)
        fits = max_runs
        if max_memory is not None:
            need = batch_bytes(cfg, dim, 1, shared)
            if need > max_memory and strict:
                raise BatchMemoryError(
                    f"--max-batch-memory = {format_bytes(max_memory)} is too small for one run of "
                    f"{cfg.task!r} (d = {dim}, n = {cfg.num_clients}, r = {cfg.clients_per_round:g}, "
                    f"K = {cfg.num_rounds}): it needs at least {format_bytes(need)} ({need} bytes)"
                )
            while fits > 1 and batch_bytes(cfg, dim, fits, shared) > max_memory:
                fits -= 1
        count = math.ceil(len(members) / fits)
        size, extra = divmod(len(members), count)
        start = 0
        for b in range(count):  # equal batches, the first ones one longer
            stop = start + size + (1 if b < extra else 0)
            plan.batches.append([item for item, _ in members[start:stop]])
            start = stop
    return plan
