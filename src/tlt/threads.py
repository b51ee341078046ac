"""How many CPU threads a single-process command should use.

Torch's intra-op pool synchronizes at every operator: with one thread per core and another process busy on one
of those cores, each op waits for the slowest thread (measured on 2 cores: 0.9 tok/s with 2 threads vs 8.7 tok/s
with 1 under load). So a command takes the cores that are idle now, not all cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
from pathlib import Path

from tlt.errors import TltError

log = logging.getLogger(__name__)


def available_cores() -> int:
    """Cores this process may run on (CPU affinity, e.g. a container's cpuset), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def idle_cores() -> int:
    """Cores not taken by other runnable processes, from the 1-minute load average (at least 1)."""
    cores = available_cores()
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores
    return max(1, min(cores, cores - int(busy + 0.5)))


def pick_threads(requested: int = 0) -> int:
    """`requested` when > 0; else the idle cores. Sets torch's intra-op pool and returns the count."""
    import torch

    if requested < 0:
        raise TltError(f"--threads must be >= 0 (0: the cores idle now), got {requested}")
    threads = requested if requested > 0 else idle_cores()
    if threads > available_cores():  # oversubscribed, each op waits for threads that share a core (~10x slower)
        log.warning("--threads %d is more than this machine's %d cores: expect every step to be several times "
                    "slower than with %d", threads, available_cores(), available_cores())
    torch.set_num_threads(threads)
    return threads


def add_threads(parser) -> None:
    """The --threads flag of a single-process command (an argparse parser), read by `pick_threads`."""
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = the cores idle now: a busy "
                        "core shared by torch's threads slows every op)")


def cpu_model() -> str:
    """The CPU's model name (Linux), for cost curves' cache keys ("cpu x2" on another machine that shares the
    cache directory is another curve) and the benchmarks' environment."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
