"""The regime edge0 exists for: each benchmark arm in a memory- and read-capped cgroup.

A model bigger than memory, read from a disk slower than compute, is studied
by running each arm's process in a cgroup of its own: a memory cap that
charges the page cache too (cgroup v1 ``memory.limit_in_bytes``, v2
``memory.max``) and a read throttle on the checkpoint's block device (v1
``blkio.throttle.read_bps_device``, v2 ``io.max rbps``). Each cgroup is made
as a child of this process's own cgroup for that controller, holds only the
arm's process, and is removed when the arm has ended; no other cgroup is
touched. An arm the OOM killer ends is a result ("OOM at 1.5 GiB"). Page
cache is charged to the cgroup that first reads a page, so a capped arm
starts from a cold page cache (pages cached by others are not charged to it).

Linux only, and the cgroup files must be writable (root, or a delegated
cgroup); :func:`regime_unavailable` says why not where they are not.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..checkpoint import CONFIG_FILE, RESIDENT_FILE, Edge0Section, read_config
from ..memory import cgroup_groups

GIB = 1 << 30
MB = 1000 * 1000
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


class CgroupError(RuntimeError):
    """A cgroup could not be made, limited, joined or removed (names the file)."""


@dataclass(frozen=True)
class Regime:
    """Memory cap and read throughput of every arm's process (None: unlimited)."""

    memory_cap_gib: Optional[float] = None
    read_mbps: Optional[float] = None

    def __post_init__(self):
        if self.memory_cap_gib is not None and not self.memory_cap_gib > 0:
            raise ValueError(f"memory cap must be a positive number of GiB, got {self.memory_cap_gib}")
        if self.read_mbps is not None and not self.read_mbps > 0:
            raise ValueError(f"read throughput must be a positive number of MB/s, got {self.read_mbps}")

    @property
    def active(self) -> bool:
        return self.memory_cap_gib is not None or self.read_mbps is not None

    def label(self) -> str:
        parts = []
        if self.memory_cap_gib is not None:
            parts.append(f"memory capped at {self.memory_cap_gib:g} GiB (page cache included)")
        if self.read_mbps is not None:
            parts.append(f"device reads throttled to {self.read_mbps:g} MB/s")
        return ", ".join(parts) or "uncapped"


@dataclass(frozen=True)
class Preset:
    """A named regime, scaled to the checkpoint it runs: the memory cap is a
    share of the checkpoint's size, the read throughput a device's bandwidth
    slowed by as much as this machine's compute is slower than the target's.
    The derivation of every figure is in BENCHMARKS.md ("Regime presets")."""

    name: str
    memory_per_model_byte: float  # GiB of cap per byte of checkpoint
    read_mbps: float
    describes: str

    def regime(self, checkpoint_bytes: int) -> Regime:
        """The preset for a checkpoint of ``checkpoint_bytes``.

        Raises:
            ValueError: the checkpoint is too small for a cap a process can run in.
        """
        cap = round(self.memory_per_model_byte * checkpoint_bytes, 2)
        if cap < MIN_CAP_GIB:
            raise ValueError(
                f"regime {self.name}: a checkpoint of {checkpoint_bytes / MB:.0f} MB scales to a memory cap of "
                f"{cap:g} GiB, too small for Python and MLX to start in ({MIN_CAP_GIB} GiB); give --memory-cap"
            )
        return Regime(cap, round(self.read_mbps))


# small-mac: the paper's MacBook M2 16 GB running qwen3.5-35b-a3b (19.5 GB of int4
# checkpoint). Memory: 12 GiB of the 16 GB left to the model (the rest to macOS and the
# user's apps). Reads: the base M2's single-NAND SSD reads 1,446 MB/s sustained, slowed by
# as much as this VM computes a token slower than the M2. Compute is what a step spends not
# waiting for reads, on the same arm (the prerouter at K=4) on both machines: the paper's M2
# A/B gives 6.4 tok/s with 101.9 ms of each step's main thread blocked on loads; this VM's
# step is a recorded sweep's wall time per decoded token, less its exposed wait (BENCHMARKS.md,
# "Regime presets"); the runtime's own step counter leaves out the step still open at the end.
MIN_CAP_GIB = 0.25
SMALL_MAC_CHECKPOINT_BYTES = 19.5e9
M2_SSD_READ_MBPS = 1446.0
M2_K4_PREROUTED_TOK_S = 6.4
M2_K4_PREROUTED_LOAD_WAIT_MS = 101.9
THIS_VM_K4_PREROUTED_COMPUTE_MS = 3534.5
M2_K4_PREROUTED_COMPUTE_MS = 1000.0 / M2_K4_PREROUTED_TOK_S - M2_K4_PREROUTED_LOAD_WAIT_MS
PRESETS = {
    "small-mac": Preset(
        "small-mac",
        memory_per_model_byte=12.0 / SMALL_MAC_CHECKPOINT_BYTES,
        read_mbps=M2_SSD_READ_MBPS * M2_K4_PREROUTED_COMPUTE_MS / THIS_VM_K4_PREROUTED_COMPUTE_MS,
        describes="a 16 GB MacBook M2 (256 GB SSD) running a checkpoint 1.22x its model memory",
    )
}


def checkpoint_bytes(root: Path) -> int:
    """Bytes of a checkpoint's model weights, what a preset scales with.

    One model gets one cap whether the bench is given its stock or its edge0
    form: an edge0 checkpoint counts its expert and resident files, not the
    prerouter heads or recovery adapters (files stock has no counterpart of).

    Raises:
        CheckpointError: an edge0 checkpoint's config.json is unreadable or malformed.
    """
    root = Path(root)
    config = read_config(root) if (root / CONFIG_FILE).is_file() else {}
    if "edge0" in config:
        section = Edge0Section.from_config(config, root / CONFIG_FILE)
        files = [root / name for name in (*section.expert_files, RESIDENT_FILE)]
        return sum(f.stat().st_size for f in files if f.is_file())
    return sum(p.stat().st_size for p in root.rglob("*.safetensors") if p.is_file())


@dataclass(frozen=True)
class CgroupLayout:
    """Where this process's own cgroups are, per controller."""

    version: int  # 1 or 2
    memory: Path
    io: Path


def own_cgroups(proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT) -> CgroupLayout:
    """This process's memory and I/O cgroup directories (v1 per-controller
    hierarchies where the memory controller is mounted there, else v2).

    Raises:
        CgroupError: no memory controller to be found.
    """
    v1, unified = cgroup_groups(proc_cgroup.read_text())
    if "memory" in v1 and (root / "memory").is_dir():
        blkio = v1.get("blkio", "/")
        return CgroupLayout(1, root / "memory" / v1["memory"].lstrip("/"), root / "blkio" / blkio.lstrip("/"))
    if unified is not None and (root / "cgroup.controllers").is_file():
        own = root / unified.lstrip("/")
        return CgroupLayout(2, own, own)
    raise CgroupError(f"{proc_cgroup}: no memory cgroup controller for this process")


def block_device(path: Path, sys_block: Path = Path("/sys/dev/block")) -> str:
    """``MAJ:MIN`` of the whole disk that holds ``path`` (throttles apply to
    disks, not partitions)."""
    st = os.stat(path)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    entry = sys_block / device
    if (entry / "partition").is_file():
        return (entry.resolve().parent / "dev").read_text().strip()
    return device


def read_ahead_file(path: Path, sys_class_bdi: Path = Path("/sys/class/bdi")) -> Path:
    """The read-ahead window of the disk (or other backing device, a FUSE view
    too) that holds ``path``: how much a page fault on a mapped file of it
    reads around the page, so what a memory-mapped peer reads a token in a cap
    depends on it, where ``O_DIRECT`` reads do not (BENCHMARKS.md, "The peer's
    reads and the disk's read-ahead")."""
    return sys_class_bdi / block_device(path) / "read_ahead_kb"


def read_ahead_kb(path: Path, sys_class_bdi: Path = Path("/sys/class/bdi")) -> Optional[int]:
    """:func:`read_ahead_file`'s value in KiB; None where it cannot be read."""
    try:
        return int(read_ahead_file(path, sys_class_bdi).read_text())
    except (OSError, ValueError):
        return None


def regime_unavailable(regime: Regime, checkpoint: Path) -> Optional[str]:
    """Why ``regime`` cannot be set up here (None: it can)."""
    if not regime.active:
        return None
    if not PROC_SELF_CGROUP.is_file():
        return "cgroups need Linux (/proc/self/cgroup)"
    try:
        layout = own_cgroups()
        if regime.read_mbps is not None:
            block_device(checkpoint)
    except (CgroupError, OSError) as e:
        return str(e)
    for directory in {layout.memory, layout.io}:
        if not os.access(directory, os.W_OK):
            return f"{directory}: not writable (run as root or in a delegated cgroup)"
    return None


class ArmCgroup:
    """One arm's cgroup(s): made and limited on enter, removed on exit.

    ``join`` is the child's ``preexec_fn``: it moves the new process into the
    cgroups before it executes anything, so all of its memory (and the page
    cache it faults in) is charged there from the start.
    """

    def __init__(self, regime: Regime, layout: CgroupLayout, device: Optional[str], name: str):
        self.regime, self.layout, self.device = regime, layout, device
        self.memory = layout.memory / name
        # v1: a blkio cgroup too, which also counts the device bytes the arm reads
        self.io = layout.io / name if layout.version == 1 else self.memory
        self.made: list[Path] = []

    def __enter__(self) -> "ArmCgroup":
        try:
            for directory in dict.fromkeys((self.memory, self.io)):
                directory.mkdir()
                self.made.append(directory)
            self._limit()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _limit(self) -> None:
        cap = None if self.regime.memory_cap_gib is None else int(self.regime.memory_cap_gib * GIB)
        rate = None if self.regime.read_mbps is None else int(self.regime.read_mbps * MB)
        if self.layout.version == 1:
            if cap is not None:
                _write(self.memory / "memory.limit_in_bytes", str(cap))
                if (self.memory / "memory.memsw.limit_in_bytes").exists():  # no swapping past the cap
                    _write(self.memory / "memory.memsw.limit_in_bytes", str(cap))
            if rate is not None:
                _write(self.io / "blkio.throttle.read_bps_device", f"{self.device} {rate}")
        else:
            wanted = ["memory", "io"]
            enabled = _read(self.layout.memory / "cgroup.subtree_control").split()
            for controller in wanted:
                if controller not in enabled:  # fails while this process's cgroup holds processes itself
                    _write(self.layout.memory / "cgroup.subtree_control", f"+{controller}")
            if cap is not None:
                _write(self.memory / "memory.max", str(cap))
                if (self.memory / "memory.swap.max").exists():
                    _write(self.memory / "memory.swap.max", "0")
            if rate is not None:
                _write(self.io / "io.max", f"{self.device} rbps={rate}")

    def join(self) -> None:
        """Move the calling process into the cgroup(s) (a ``preexec_fn``)."""
        for directory in self.made:
            (directory / "cgroup.procs").write_text(str(os.getpid()))

    def stats(self) -> dict:
        """Peak memory (page cache included), OOM kills and device bytes read."""
        out: dict = {"cgroup_version": self.layout.version}
        if self.layout.version == 1:
            out["cgroup_peak_bytes"] = int(_read(self.memory / "memory.max_usage_in_bytes"))
            out["oom_kills"] = _field(_read(self.memory / "memory.oom_control"), "oom_kill")
            out["device_read_bytes"] = _v1_read_bytes(_read(self.io / "blkio.throttle.io_service_bytes"), self.device)
        else:
            if (self.memory / "memory.peak").exists():
                out["cgroup_peak_bytes"] = int(_read(self.memory / "memory.peak"))
            out["oom_kills"] = _field(_read(self.memory / "memory.events"), "oom_kill")
            out["device_read_bytes"] = _v2_read_bytes(_read(self.io / "io.stat"), self.device)
        return out

    def _remove(self) -> None:
        for directory in reversed(self.made):
            for attempt in range(50):  # the last task may still be leaving
                try:
                    directory.rmdir()
                    break
                except OSError as e:
                    if attempt == 49:
                        raise CgroupError(f"{directory}: cannot remove the cgroup ({e.strerror})") from None
                    time.sleep(0.1)
        self.made = []


def _write(file: Path, value: str) -> None:
    try:
        file.write_text(value)
    except OSError as e:
        raise CgroupError(f"{file}: cannot write {value!r} ({e.strerror})") from None


def _read(file: Path) -> str:
    return file.read_text() if file.exists() else ""


def _field(text: str, name: str) -> Optional[int]:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return None


def _v1_read_bytes(text: str, device: Optional[str]) -> Optional[int]:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read" and (device is None or parts[0] == device):
            return int(parts[2])
    return 0 if device is not None else None


def _v2_read_bytes(text: str, device: Optional[str]) -> Optional[int]:
    for line in text.splitlines():
        dev, *pairs = line.split()
        if device is None or dev == device:
            fields = dict(p.split("=", 1) for p in pairs if "=" in p)
            return int(fields.get("rbytes", 0))
    return 0 if device is not None else None
