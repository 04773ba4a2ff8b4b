"""A process's resident memory, read from /proc (Linux): what the benchmarks record and what the
server states its bound against."""

from __future__ import annotations

import os
import resource


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (`VmRSS`) or at its peak (`VmHWM`), MB."""
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) / 1024 for line in handle if line.startswith(field))


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far: its own (`VmHWM`), where getrusage's maximum
    would carry a parent's peak over into a spawned child."""
    return rss_mb(os.getpid(), "VmHWM")


def current_rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def reset_peak(pid: int) -> None:
    """Start `pid`'s peak (`VmHWM`) again from its resident memory now (Linux `clear_refs`)."""
    with open(f"/proc/{pid}/clear_refs", "w") as handle:
        handle.write("5")
