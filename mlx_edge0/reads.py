"""Positioned reads on the expert store's I/O threads: a file range into
destination memoryviews, and nothing else (no MLX calls: I/O threads touch
only memoryviews and file descriptors).

A run of adjacent expert bundles is one ``preadv`` (:func:`read_run`);
scales and biases stored narrower than the compute dtype land in the
thread's scratch and are widened into their rows. With ``O_DIRECT`` a read
whose destinations are whole, aligned pages lands in place; any other goes
through the thread's page-aligned bounce buffer and is copied on. A short
read means the file was truncated or replaced: :class:`ExpertReadError`
names the file and the byte range.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from pathlib import Path

import numpy as np

from .slots import PAGE, address
from .tensorfile import TensorFileError

IOV_MAX = 1024
DIRECT_BLOCK = PAGE  # O_DIRECT alignment of offsets, lengths and buffers
DIRECT_CHUNK = 8 << 20  # bytes per O_DIRECT read (each I/O thread's bounce buffer)
SCRATCH_KEEP = 1 << 20  # widening scratch an I/O thread keeps between reads
DIRECT_FLAG = getattr(os, "O_DIRECT", 0)  # 0 where the OS has none (macOS: F_NOCACHE instead)


class ExpertReadError(OSError):
    """Reading expert bytes failed (I/O error, truncated file)."""


def open_for_reads(path: Path, bypass_page_cache: bool) -> int:
    """A read descriptor; with ``bypass_page_cache`` one whose reads skip the
    OS page cache, or a :class:`TensorFileError` naming the file when its
    filesystem (or this OS) cannot do that."""
    if not bypass_page_cache:
        return os.open(path, os.O_RDONLY)
    if DIRECT_FLAG:
        try:
            return os.open(path, os.O_RDONLY | DIRECT_FLAG)
        except OSError as e:
            raise TensorFileError(
                f"{path}: cannot open for direct reads (O_DIRECT: {e.strerror}); "
                "its filesystem may not support them: use page_cache='keep'"
            ) from None
    if sys.platform == "darwin":
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        return fd
    raise TensorFileError(f"{path}: this OS has no uncached reads; use page_cache='keep'")


_per_thread = threading.local()


def _thread_buffer(name: str, size: int) -> mmap.mmap:
    """This I/O thread's page-aligned buffer ``name`` of ``size`` bytes, kept
    between reads (a thread does one read at a time)."""
    held = getattr(_per_thread, name, None)
    if held is None or len(held) != size:
        held = mmap.mmap(-1, size)
        setattr(_per_thread, name, held)
    return held


def _widening_scratch(nbytes: int) -> memoryview:
    """A page-aligned buffer for on-disk scales and biases before they are
    widened: this I/O thread's own, or for a read larger than it keeps (a
    whole-layer run), one of its own."""
    if nbytes > SCRATCH_KEEP:
        return memoryview(mmap.mmap(-1, nbytes))
    return memoryview(_thread_buffer("scratch", SCRATCH_KEEP))[:nbytes]


def _lands_in_place(views: list[memoryview], offset: int) -> bool:
    """Whether an O_DIRECT read can fill ``views`` directly: every one a
    whole number of blocks at a block-aligned address, from an aligned offset."""
    return offset % DIRECT_BLOCK == 0 and all(
        v.nbytes % DIRECT_BLOCK == 0 and address(v) % DIRECT_BLOCK == 0 for v in views
    )


def _pread_direct(fd: int, views: list[memoryview], offset: int, path: Path) -> int:
    """Fill ``views`` with the bytes at ``offset`` through O_DIRECT: aligned
    chunk reads into the thread's bounce buffer, each copied on into the views
    (numpy copies without the GIL). A short read means a truncated file."""
    buffer = _thread_buffer("bounce", DIRECT_CHUNK)
    chunk = np.frombuffer(buffer, np.uint8)
    targets = [np.frombuffer(v, np.uint8) for v in views]
    total = sum(v.nbytes for v in views)
    position = offset - offset % DIRECT_BLOCK
    skip = offset - position
    remaining = total
    t, into = 0, 0  # next target and the byte in it
    while remaining:
        want = min(DIRECT_CHUNK, -(-(skip + remaining) // DIRECT_BLOCK) * DIRECT_BLOCK)
        try:
            n = os.preadv(fd, [memoryview(buffer)[:want]], position)
        except OSError as e:
            raise ExpertReadError(
                e.errno, f"{path}: direct read of {total} bytes at offset {offset} failed: {e.strerror}"
            ) from None
        available = min(n - skip, remaining)
        if available <= 0 or (available < remaining and n % DIRECT_BLOCK):
            raise ExpertReadError(
                f"{path}: short read {total - remaining + max(available, 0)}/{total} bytes at offset "
                f"{offset} (the file is truncated or was replaced)"
            )
        source = skip
        end = skip + available
        while source < end:
            m = min(targets[t].size - into, end - source)
            np.copyto(targets[t][into : into + m], chunk[source : source + m])
            source += m
            into += m
            if into == targets[t].size:
                t, into = t + 1, 0
        remaining -= available
        position += n
        skip = 0
    return total


def _preadv_exact(fd: int, views: list[memoryview], offset: int, path: Path, direct: bool = False) -> int:
    """preadv until every view is full; a short read means a truncated file
    (with ``direct``, so does one that ends off a block: O_DIRECT could not
    go on from there)."""
    total = sum(v.nbytes for v in views)
    done = 0
    pending = views
    while pending:
        try:
            n = os.preadv(fd, pending[:IOV_MAX], offset + done)
        except OSError as e:
            raise ExpertReadError(
                e.errno, f"{path}: read of {total} bytes at offset {offset} failed: {e.strerror}"
            ) from None
        if n == 0 or (direct and n % DIRECT_BLOCK and done + n < total):
            done += n
            raise ExpertReadError(
                f"{path}: short read {done}/{total} bytes at offset {offset} (the file is truncated or was replaced)"
            )
        done += n
        while pending and n >= pending[0].nbytes:
            n -= pending[0].nbytes
            pending = pending[1:]
        if pending and n:
            pending = [pending[0][n:]] + pending[1:]
    return total


def _convert(src: memoryview, dst: memoryview, src_code: str, dst_code: str) -> None:
    """Widen scales/biases into the compute dtype (exactly as ``astype`` would)."""
    if src_code == "BF16" and dst_code == "F32":
        np.left_shift(np.frombuffer(src, np.uint16), 16, out=np.frombuffer(dst, np.uint32), dtype=np.uint32)
    elif src_code == "F16" and dst_code == "F32":
        np.frombuffer(dst, np.float32)[:] = np.frombuffer(src, np.float16)
    else:  # pragma: no cover - guarded by convertible()
        raise ValueError(f"cannot convert {src_code} to {dst_code}")


def convertible(src_code: str, dst_code: str) -> bool:
    return src_code == dst_code or (src_code, dst_code) in (("BF16", "F32"), ("F16", "F32"))


def read_run(
    fd: int,
    parts: list[tuple[memoryview, int]],
    offset: int,
    path: Path,
    src_code: str,
    dst_code: str,
    drop_pages: bool,
    direct: bool,
) -> int:
    """I/O thread: one coalesced read, widen scales, optionally drop the
    range from the page cache. No MLX calls here.

    ``parts`` are the destinations in file order with their bytes on disk:
    a destination of another size gets the disk bytes in this thread's
    scratch, widened into it after the read."""
    widened = sum(n for view, n in parts if view.nbytes != n)
    scratch = _widening_scratch(widened) if widened else None
    views, conversions, at = [], [], 0
    for view, n in parts:
        if view.nbytes != n:
            src = scratch[at : at + n]
            at += n
            conversions.append((src, view))
            view = src
        views.append(view)
    if not direct:
        n = _preadv_exact(fd, views, offset, path)
    elif _lands_in_place(views, offset):
        n = _preadv_exact(fd, views, offset, path, direct=True)
    else:
        n = _pread_direct(fd, views, offset, path)
    for src, dst in conversions:
        _convert(src, dst, src_code, dst_code)
    if drop_pages:
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
    return n
