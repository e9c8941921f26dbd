"""Available memory: the machine's figure (psutil), capped by the process's cgroup limit."""

from __future__ import annotations

from pathlib import Path

from mlx_edge0.memory import available_memory, cgroup_headroom
from mlx_edge0.options import GIB

MIB = 1 << 20


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_v2_limit_minus_usage_with_inactive_file_pages_left_out(tmp_path):
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/user.slice/app.scope\n",
            "sys/fs/cgroup/memory.max": "max\n",  # the root has no limit
            "sys/fs/cgroup/user.slice/memory.max": f"{4 * GIB}\n",
            "sys/fs/cgroup/user.slice/memory.current": f"{1 * GIB}\n",
            "sys/fs/cgroup/user.slice/app.scope/memory.max": f"{2 * GIB}\n",
            "sys/fs/cgroup/user.slice/app.scope/memory.current": f"{1536 * MIB}\n",
            "sys/fs/cgroup/user.slice/app.scope/memory.stat": f"anon 1\ninactive_file {256 * MIB}\nactive_file 7\n",
        },
    )
    assert cgroup_headroom(root) == 2 * GIB - (1536 - 256) * MIB  # the tighter of the two levels
    assert available_memory(root) == 768 * MIB  # this machine has more than that available


def test_cgroup_v1_limit_at_the_container_root_when_the_host_path_is_absent(tmp_path):
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GIB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{512 * MIB}\n",
            "sys/fs/cgroup/memory/memory.stat": f"cache 9\ntotal_inactive_file {128 * MIB}\n",
        },
    )
    assert cgroup_headroom(root) == GIB - 384 * MIB


def test_no_cgroup_limit_leaves_the_machine_figure(tmp_path):
    assert cgroup_headroom(tmp_path) is None  # no proc/self/cgroup: macOS, or not mounted
    root = _tree(
        tmp_path,
        {"proc/self/cgroup": "0::/a\n", "sys/fs/cgroup/a/memory.max": "max\n", "sys/fs/cgroup/a/memory.current": "5\n"},
    )
    assert cgroup_headroom(root) is None
