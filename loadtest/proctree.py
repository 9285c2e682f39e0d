"""CPU time and memory of a process and its descendants, from Linux /proc (for overhead figures).

`/proc/<pid>/stat` fields 14-15 (utime, stime; clock ticks) give CPU time; live children are found
by their parent pid (field 4), because the kernel's `cutime`/`cstime` count only children that have
exited and been waited for. `/proc/<pid>/status` gives `VmRSS` (resident now) and `VmHWM` (its peak
since start), in kB. Off Linux, or for a process that is gone, the readers return None.
"""

from __future__ import annotations

import os
from pathlib import Path

from loadtest.procs import process_cpu_seconds

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """`root` and every live process below it (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(PROC)
    except OSError:
        return [root]
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds used so far by `pids` together (None when none can be read)."""
    values = [v for v in (process_cpu_seconds(pid) for pid in pids) if v is not None]
    return sum(values) if values else None


def status_kb(pid: int, key: str) -> int | None:
    """A `kB` line of /proc/<pid>/status (`VmRSS`, `VmHWM`...), or None."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_kb(pids: list[int]) -> int | None:
    """Resident memory of `pids` together, kB (shared pages count once per process)."""
    values = [v for v in (status_kb(pid, "VmRSS") for pid in pids) if v is not None]
    return sum(values) if values else None
