"""What one bench measurement is and what it reads of the machine: the
child's spec, the token sequence every arm is fed, the checkpoint's files
and their page cache, the device's and the process's counters.

Shared by the parent (:mod:`mlx_edge0.bench.runner`) and by both kinds of
child (:mod:`mlx_edge0.bench.measure` for MLX arms,
:mod:`mlx_edge0.bench.peer_measure` for llama.cpp), so neither child imports
the other's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16", "native")
WARMUP_STEPS = 2


def forced_tokens(vocab: int, count: int, seed: int) -> list[int]:
    """The fixed token sequence a teacher-forced decode feeds, one per step
    (the prompt is drawn from ``seed``, this from the next seed but one)."""
    import numpy as np

    return np.random.default_rng(seed + 2).integers(0, vocab, count).tolist()


def checkpoint_files(root: Path) -> list[Path]:
    if Path(root).is_file():  # a GGUF
        return [Path(root)]
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def drop_page_cache(files: list[Path], sync: bool = False) -> bool:
    """Ask the OS to drop ``files`` from the page cache; False where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if sync:
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


@dataclass(frozen=True)
class RunSpec:
    """What one child measures.

    Attributes:
        k: K on the prerouted layers of edge0 arms (0 = the heads' K); stock stays native.
        warm_prefill: also time a second request in the same process.
        evict_between_steps: drop the checkpoint's pages from the page cache
            before every decode step (untimed): the page cache cannot help, as
            when the checkpoint does not fit in memory.
        profile: cProfile the decode steps (their times are then inflated).
    """

    arm: str
    path: Path
    prompt_tokens: int
    decode_tokens: int
    dtype: str
    seed: int
    k: int = 0
    warm_prefill: bool = False
    evict_between_steps: bool = False
    profile: bool = False

    def argv(self) -> list[str]:
        flags = [
            sys.executable, "-m", "mlx_edge0.bench.measure",
            "--arm", self.arm, "--path", str(Path(self.path).resolve()),
            "--prompt-tokens", str(self.prompt_tokens),
            "--decode-tokens", str(self.decode_tokens),
            "--dtype", self.dtype, "--seed", str(self.seed), "--k", str(self.k),
        ]  # fmt: skip
        for flag, on in (("--warm-prefill", self.warm_prefill),
                         ("--evict-between-steps", self.evict_between_steps),
                         ("--profile", self.profile)):  # fmt: skip
            if on:
                flags.append(flag)
        return flags


def device_read_bytes() -> int:
    """Bytes the kernel fetched from storage for this process so far (Linux
    ``/proc/self/io``; page-cache hits cost none, read-ahead counts), or 0."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith("read_bytes:")), 0)


def peak_rss_bytes() -> int:
    """This process's peak resident set so far, in bytes (``ru_maxrss`` is KiB on Linux)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
