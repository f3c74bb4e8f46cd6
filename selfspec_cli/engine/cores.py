"""How many cores this process may use: the CPUs of its affinity mask, counted once per physical
core (hyperthread siblings share one core's FMA units and caches), and capped by its cgroup's CPU
quota. The default ``--threads`` (session.py) and a library caller's default pool size
(kernels.py) read it, as llama.cpp's ``-t`` defaults to the physical cores.

Invariants: never below 1; a file that cannot be read (no /sys, no cgroup) counts as no limit
from that source, so the answer falls back to the logical CPUs of the mask. Imports nothing heavy.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Cores:
    logical: int  # CPUs in the affinity mask
    physical: int  # distinct (package, core) among them
    quota: float | None  # the cgroup's CPU quota in cores, None when unlimited or unknown

    @property
    def usable(self) -> int:
        n = self.physical
        if self.quota is not None:
            n = min(n, max(1, math.ceil(self.quota - 1e-9)))
        return max(1, n)

    def describe(self) -> dict[str, object]:
        return {"logical": self.logical, "physical": self.physical, "quota": self.quota, "usable": self.usable}


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota in cores (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    v2 = _read(root / "cpu.max")
    if v2:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                return int(parts[0]) / int(parts[1])
            except (ValueError, ZeroDivisionError):
                return None
        return None
    quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    try:
        if quota is not None and period is not None and int(quota) > 0 and int(period) > 0:
            return int(quota) / int(period)
    except ValueError:
        pass
    return None


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct physical cores among ``cpus`` (by package and core id; a CPU whose topology cannot be
    read counts as its own core)."""
    seen: set[tuple[str, str] | tuple[str, int]] = set()
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        core, package = _read(topo / "core_id"), _read(topo / "physical_package_id")
        seen.add((package, core) if core is not None and package is not None else ("cpu", cpu))
    return max(1, len(seen))


def cores() -> Cores:
    if hasattr(os, "sched_getaffinity"):
        cpus = set(os.sched_getaffinity(0))
    else:  # pragma: no cover - not Linux
        cpus = set(range(os.cpu_count() or 1))
    return Cores(logical=len(cpus), physical=physical_cores(cpus), quota=cgroup_quota())


def usable_cores() -> int:
    """The default thread count: physical cores in the affinity mask, capped by the cgroup quota."""
    return cores().usable
