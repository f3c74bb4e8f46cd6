"""engine/cores.py: the default thread count from a real-shaped sysfs and cgroup tree (written in the test):
hyperthread siblings count once, a cgroup quota caps the count, unreadable files mean no limit."""
from __future__ import annotations

from pathlib import Path

from selfspec_cli.engine.cores import Cores, cgroup_quota, cores, physical_cores


def _sysfs(root: Path, topology: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in topology.items():
        t = root / f"cpu{cpu}" / "topology"
        t.mkdir(parents=True)
        (t / "physical_package_id").write_text(f"{package}\n")
        (t / "core_id").write_text(f"{core}\n")
    return root


def test_siblings_count_once_and_unknown_cpus_count_alone(tmp_path):
    # 2 packages; cpus 0/4 and 1/5 are hyperthread pairs; cpu 2 is alone; cpu 9 has no topology files
    sysfs = _sysfs(tmp_path, {0: (0, 0), 4: (0, 0), 1: (0, 1), 5: (0, 1), 2: (1, 0)})
    assert physical_cores({0, 4, 1, 5, 2}, sysfs) == 3
    assert physical_cores({0, 4}, sysfs) == 1
    assert physical_cores({0, 9}, sysfs) == 2
    assert physical_cores(set(), sysfs) == 1


def test_cgroup_quota_v2_v1_and_unlimited(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(v1) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(v1) is None
    assert cgroup_quota(tmp_path / "none") is None


def test_usable_is_physical_capped_by_the_quota_never_below_one():
    assert Cores(logical=8, physical=4, quota=None).usable == 4
    assert Cores(logical=8, physical=4, quota=1.5).usable == 2  # a partial core still runs a thread
    assert Cores(logical=8, physical=4, quota=0.2).usable == 1
    assert Cores(logical=2, physical=2, quota=8.0).usable == 2
    here = cores()
    assert 1 <= here.usable <= here.physical <= here.logical
