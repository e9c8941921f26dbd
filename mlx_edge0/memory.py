"""How much memory this process could take now: what ``cache_gib="auto"``
and the bench's wait-for-memory size themselves from.

The machine's figure comes from psutil (MemAvailable on Linux, free +
inactive + purgeable pages on macOS), so every platform gets a real number.
On Linux a container's cgroup limit can be far below it, and exceeding that
limit gets the process killed, so the headroom under the process's own
memory cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, at every
level from the mount root down to the process's group) caps it. A group's
usage counts its page cache; the inactive file pages are left out, as
``docker stats`` does, since the kernel drops them before it kills.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import psutil

ROOT = Path("/")
# (controller dir under sys/fs/cgroup, limit file, usage file, inactive-file key of memory.stat)
V2 = ("", "memory.max", "memory.current", "inactive_file")
V1 = ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def available_memory(root: Path = ROOT) -> int:
    """Bytes this process could allocate now: the machine's available memory,
    capped by the headroom under its cgroup's memory limit (Linux)."""
    machine = int(psutil.virtual_memory().available)
    headroom = cgroup_headroom(root)
    return machine if headroom is None else min(machine, headroom)


def cgroup_headroom(root: Path = ROOT) -> Optional[int]:
    """Limit minus usage of the tightest memory cgroup level above this
    process, or None without a limit (or without cgroups: macOS).

    Args:
        root: the filesystem root holding ``proc/self/cgroup`` and
            ``sys/fs/cgroup`` (a fake tree in tests).
    """
    try:
        v1, unified = cgroup_groups((root / "proc/self/cgroup").read_text())
    except OSError:
        return None
    headrooms = []
    if "memory" in v1:
        headrooms += _headrooms(root / "sys/fs/cgroup" / V1[0], v1["memory"], V1)
    if unified is not None:
        headrooms += _headrooms(root / "sys/fs/cgroup" / V2[0], unified, V2)
    return min(headrooms) if headrooms else None


def cgroup_groups(proc_self_cgroup: str) -> tuple[dict[str, str], Optional[str]]:
    """The groups of ``/proc/self/cgroup``'s text: v1 controller -> group, and
    the v2 (unified) group or None. Lines that are not ``id:controllers:group``
    are skipped."""
    v1: dict[str, str] = {}
    unified = None
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, group = parts
        if hierarchy == "0" and controllers == "":
            unified = group
        for controller in filter(None, controllers.split(",")):
            v1[controller] = group
    return v1, unified


def _headrooms(mount: Path, group: str, layout: tuple[str, str, str, str]) -> list[int]:
    """Headroom at each level of ``group`` that exists under ``mount`` and has a limit.

    A container sees its own group as the mount root while /proc/self/cgroup
    may name the host's path, so missing levels are skipped, not errors."""
    _, limit_file, usage_file, inactive_key = layout
    parts = [p for p in group.split("/") if p]
    out = []
    for depth in range(len(parts) + 1):
        level = mount.joinpath(*parts[:depth])
        limit = _read_int(level / limit_file)
        usage = _read_int(level / usage_file)
        if limit is None or usage is None:
            continue
        inactive = _stat(level / "memory.stat").get(inactive_key, 0)
        out.append(max(0, limit - max(0, usage - inactive)))
    return out


def _read_int(path: Path) -> Optional[int]:
    """An integer file's value; None when missing, unreadable or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
