"""Checkpoint integrity: generation ids, per-file checksums, finite floats.

Invariants:
- ``edge0 convert`` stamps a fresh random *generation* into config.json's
  ``edge0.generation`` and into the ``__metadata__`` of every safetensors
  file it writes (experts, resident; heads and adapters saved later copy
  the checkpoint's). Expert and resident files of a checkpoint with a
  generation must carry exactly it; heads and adapters, when they carry one.
  A mismatch means files of two conversions are mixed and is refused,
  naming the file. Checkpoints without one (made before generations
  existed) are not checked.
- ``edge0.sha256`` maps every file convert wrote (and the heads, routing
  profile and adapter files saved into it later: :func:`record_sha256`) to its SHA-256,
  so :func:`verify` finds files changed in place (tampering, bit rot) as
  well as non-finite scales.
- :func:`load_consistently` makes a load see one conversion: it notes
  config.json before and after loading and loads again when
  ``convert --force`` (or a heads save) replaced it meanwhile.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

import numpy as np

from .checkpoint import (
    CONFIG_FILE,
    RESIDENT_FILE,
    CheckpointError,
    Edge0Section,
    read_config,
)
from .tensorfile import TensorEntry, TensorFileError, read_header

GENERATION_KEY = "generation"
LOAD_ATTEMPTS = 8
HASH_CHUNK = 8 << 20
# Non-finite iff every exponent bit is set; float16/bfloat16 have no numpy
# dtype of their own here, so they are tested on their bit patterns.
EXPONENT_MASKS = {"BF16": (np.uint16, 0x7F80), "F16": (np.uint16, 0x7C00), "F32": (np.uint32, 0x7F800000)}
NO_CHECKSUMS = "no checksums recorded; re-convert to get them"

T = TypeVar("T")


def new_generation() -> str:
    """A fresh id for one conversion (64 random bits, hex)."""
    return secrets.token_hex(8)


def record_sha256(config: dict, name: str, digest: str) -> bool:
    """Record a file saved after convert in config.json's ``edge0.sha256``,
    so ``edge0 info --verify`` covers it. A checkpoint convert recorded no
    checksums for is left without (True when recorded: write the config)."""
    recorded = config["edge0"].get("sha256")
    if not isinstance(recorded, dict):
        return False
    recorded[name] = digest
    return True


def check_generation(
    path: Path | str, metadata: dict[str, str], expected: Optional[str], required: bool = True
) -> None:
    """Refuse a safetensors file whose generation is not config.json's.

    Args:
        metadata: the file's ``__metadata__``.
        expected: config.json's ``edge0.generation`` (None: not checked).
        required: a file without a generation is refused too (expert and
            resident files); otherwise only a different one is.

    Raises:
        TensorFileError: naming the file and both generations.
    """
    got = metadata.get(GENERATION_KEY)
    if expected is None or got == expected or (got is None and not required):
        return
    raise TensorFileError(
        f"{path}: generation {got!r} does not match generation {expected!r} in {CONFIG_FILE}: "
        "files of two conversions are mixed (the checkpoint was replaced while it was read, "
        "or a file was copied in from another conversion); load again, or re-convert"
    )


def sha256_file(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def nonfinite_count(raw: np.ndarray | memoryview | bytes, dtype: str) -> int:
    """NaN/inf values among the little-endian ``dtype`` values in ``raw``
    (0 for integer dtypes)."""
    if dtype not in EXPONENT_MASKS:
        return 0
    bits, mask = EXPONENT_MASKS[dtype]
    values = np.frombuffer(raw, bits)
    return int(np.count_nonzero((values & bits(mask)) == bits(mask)))


def plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


# --- one load, one conversion -----------------------------------------------


def _stamp(path: Path) -> tuple:
    """What identifies the checkpoint at ``path`` now: config.json's inode
    (convert and heads saves replace the file) and generation."""
    try:
        st = os.stat(path / CONFIG_FILE)
        generation = read_config(path).get("edge0", {}).get(GENERATION_KEY)
    except (OSError, CheckpointError, AttributeError):
        return ("unreadable",)
    return (st.st_dev, st.st_ino, generation)


def load_consistently(path: Path | str, load: Callable[[], T], attempts: int = LOAD_ATTEMPTS) -> T:
    """``load()`` of the checkpoint at ``path``, retried while the checkpoint
    is being replaced, so that what it returns comes from one conversion.

    A failure while config.json stayed the same is raised as is; one while
    it changed (a file vanished or mismatched mid-swap) is retried.

    Raises:
        CheckpointError: the checkpoint changed during every attempt.
    """
    path = Path(path)
    for attempt in range(attempts):
        before = _stamp(path)
        try:
            result = load()
        except Exception:
            if _stamp(path) == before:
                raise
        else:
            if _stamp(path) == before:
                return result
        time.sleep(0.01 * (attempt + 1))
    raise CheckpointError(
        f"{path / CONFIG_FILE}: the checkpoint was replaced during each of {attempts} loads "
        "(is `edge0 convert --force` rewriting it in a loop?); load it again once that is done"
    )


# --- edge0 info --verify ------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One finding of :func:`verify`: a file (relative to the checkpoint) and what is wrong."""

    file: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}: {self.problem}"


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked and found."""

    path: str
    checksums_recorded: bool
    checked_files: int  # files compared with their recorded SHA-256
    scanned_tensors: int  # float tensors checked for NaN/inf
    unrecorded: tuple[str, ...]  # files present without a recorded checksum
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["unrecorded"] = list(self.unrecorded)
        d["problems"] = [asdict(p) for p in self.problems]
        return d


def verify(path: Path | str, progress: Optional[Callable[[int, int, str], None]] = None) -> VerifyReport:
    """Re-hash every file whose checksum config.json records, check every float
    tensor of the expert, resident and heads files for NaN/inf, and every
    header's generation; one file at a time (``progress(done, total, file)``
    before each), so memory stays flat on big checkpoints.

    Raises:
        CheckpointError: config.json is unreadable or has no valid edge0 section.
    """
    path = Path(path)
    section = Edge0Section.from_config(read_config(path), path / CONFIG_FILE)
    recorded = section.sha256 or {}
    tensor_files = [*section.expert_files, RESIDENT_FILE]
    heads = (section.prerouter or {}).get("file")
    optional = [f for f in (heads, "adapters.safetensors") if f and (path / f).is_file()]
    names = list(dict.fromkeys(tensor_files + optional + sorted(recorded)))
    problems: list[Problem] = []
    scanned = 0
    for done, name in enumerate(names):
        if progress is not None:
            progress(done, len(names), name)
        file = path / name
        if not file.is_file():
            problems.append(Problem(name, "missing"))
            continue
        try:
            if name in recorded and sha256_file(file) != recorded[name]:
                problems.append(
                    Problem(
                        name, "sha256 does not match the one recorded in config.json (changed in place, or bit rot)"
                    )
                )
            if name.endswith(".safetensors"):
                found, n = _scan_tensors(file, section.generation, required=name in tensor_files)
                problems += [Problem(name, p) for p in found]
                scanned += n
        except OSError as e:  # permissions, an I/O error of a failing disk
            problems.append(Problem(name, f"unreadable ({e.strerror or e})"))
    present = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")}
    unrecorded = tuple(sorted(present - set(recorded) - {CONFIG_FILE})) if recorded else ()
    return VerifyReport(
        str(path.resolve()), bool(recorded), sum(n in recorded for n in names), scanned, unrecorded, tuple(problems)
    )


def _scan_tensors(file: Path, generation: Optional[str], required: bool) -> tuple[list[str], int]:
    """Problems of one safetensors file (header, generation, non-finite
    float tensors) and how many float tensors were checked."""
    try:
        header = read_header(file)
        check_generation(file.name, header.metadata, generation, required)
    except TensorFileError as e:
        return [str(e).split(": ", 1)[-1]], 0
    floats = [e for e in header.entries.values() if e.dtype in EXPONENT_MASKS and e.nbytes]
    if not floats:
        return [], 0
    data = np.memmap(file, np.uint8, mode="r")
    try:
        return [p for e in floats if (p := _nonfinite_problem(data, e))], len(floats)
    finally:
        del data


def _nonfinite_problem(data: np.ndarray, entry: TensorEntry) -> Optional[str]:
    n = nonfinite_count(data[entry.start : entry.end], entry.dtype)
    return f"{entry.name}: {plural(n, 'non-finite value')} (NaN/inf)" if n else None


def format_verify(report: VerifyReport) -> str:
    """The ``edge0 info --verify`` lines."""
    lines = []
    if not report.checksums_recorded:
        lines.append(f"  verify          {NO_CHECKSUMS}")
    if report.ok:
        lines.append(
            f"  verify          ok: {plural(report.checked_files, 'file')} match their recorded "
            f"sha256, {plural(report.scanned_tensors, 'float tensor')} finite, generations agree"
        )
    else:
        lines.append(f"  verify          FAILED: {plural(len(report.problems), 'problem')}")
        lines += [f"    {p}" for p in report.problems]
    if report.unrecorded:
        lines.append(f"  not covered     {', '.join(report.unrecorded)} (written after convert; no checksum)")
    return "\n".join(lines)


__all__ = [
    "GENERATION_KEY",
    "Problem",
    "VerifyReport",
    "check_generation",
    "format_verify",
    "load_consistently",
    "new_generation",
    "nonfinite_count",
    "record_sha256",
    "sha256_file",
    "verify",
]
