"""A disk that is slow rather than throttled: a read-only FUSE view of a
folder whose reads are served at a fixed rate, first come first served, with
the time the disk idles lost (as on a slow disk), not handed to later reads
as the kernel's block throttle hands it (BENCHMARKS.md, "What the throttle
gives a call's reads").

Every read the kernel sends (128 KiB at most each; buffered and ``O_DIRECT``
opens alike, page cache of the view charged to the reader as on any file
system) takes its place on one clock: it starts when the disk is free or
when it arrives, whichever is later, and returns ``bytes / rate`` after
that. The bytes come from the folder underneath at its own speed first.
Run the bench on the view with ``--memory-cap`` only (the throttle needs a
block device; this view is not one, so the runs' device bytes read 0):

    pip install pyfuse3                 # needs libfuse3-dev (apt) to build
    python benchmarks/paced_disk.py $DATA /mnt/paced --read-mbps 50 &
    edge0 bench run --edge0 /mnt/paced/ling-edge0 --memory-cap 2.76 ...
    kill %1                             # ends the server and unmounts the view

On exit it prints the bytes it served and the time it spent serving them.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
from pathlib import Path

import pyfuse3
import trio

CACHE_S = 3600.0  # the view is read-only: entries and attributes never change


class DiskClock:
    """One disk at ``rate`` bytes a second: each read's end time, in arrival order."""

    def __init__(self, rate: float):
        self.rate = rate
        self.free_at = 0.0
        self.served = 0
        self.busy_s = 0.0

    def done_at(self, nbytes: int, now: float) -> float:
        start = max(now, self.free_at)  # an idle disk's time is gone, not banked
        self.free_at = start + nbytes / self.rate
        self.served += nbytes
        self.busy_s += nbytes / self.rate
        return self.free_at


class PacedView(pyfuse3.Operations):
    """``source`` read-only, its reads paced by ``clock``."""

    def __init__(self, source: Path, clock: DiskClock):
        super().__init__()
        self.clock = clock
        self.path_of = {pyfuse3.ROOT_INODE: source}
        self.inode_of = {os.stat(source).st_ino: pyfuse3.ROOT_INODE}

    def _inode(self, path: Path) -> int:
        st_ino = os.lstat(path).st_ino
        if st_ino not in self.inode_of:
            self.inode_of[st_ino] = len(self.path_of) + pyfuse3.ROOT_INODE
            self.path_of[self.inode_of[st_ino]] = path
        return self.inode_of[st_ino]

    def _attributes(self, inode: int) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(self.path_of[inode])
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        entry = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks"):
            setattr(entry, name, getattr(st, name))
        entry.st_mode &= ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
        entry.st_ino = inode
        entry.st_blksize = st.st_blksize
        entry.st_atime_ns, entry.st_mtime_ns, entry.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        entry.entry_timeout = entry.attr_timeout = CACHE_S
        return entry

    async def lookup(self, parent_inode, name, ctx=None):
        path = self.path_of[parent_inode] / os.fsdecode(name)
        if not os.path.lexists(path):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attributes(self._inode(path))

    async def getattr(self, inode, ctx=None):
        return self._attributes(inode)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        names = sorted(os.listdir(self.path_of[fh]))
        for i, name in enumerate(names[start_id:], start_id):
            inode = self._inode(self.path_of[fh] / name)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attributes(inode), i + 1):
                break

    async def releasedir(self, fh):
        pass

    async def readlink(self, inode, ctx):
        try:
            return os.fsencode(os.readlink(self.path_of[inode]))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    async def open(self, inode, flags, ctx):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        try:
            return pyfuse3.FileInfo(fh=os.open(self.path_of[inode], os.O_RDONLY))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None

    async def read(self, fh, off, size):
        try:
            data = os.pread(fh, size, off)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        await trio.sleep_until(self.clock.done_at(len(data), trio.current_time()))
        return data

    async def release(self, fh):
        os.close(fh)

    async def statfs(self, ctx):
        st = os.statvfs(self.path_of[pyfuse3.ROOT_INODE])
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail"):
            setattr(out, name, getattr(st, name))
        out.f_namemax = st.f_namemax
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="the folder to serve")
    p.add_argument("mountpoint", type=Path, help="an empty folder to mount the view on")
    p.add_argument("--read-mbps", type=float, required=True, help="the disk's rate, MB/s")
    a = p.parse_args()
    if not a.read_mbps > 0:
        p.error(f"--read-mbps must be positive, got {a.read_mbps}")
    for name, folder in (("source", a.source), ("mountpoint", a.mountpoint)):
        if not folder.is_dir():
            p.error(f"{name} {folder}: not a folder")
    clock = DiskClock(a.read_mbps * 1e6)
    pyfuse3.init(PacedView(a.source.resolve(), clock), str(a.mountpoint), {"fsname=edge0-paced", "ro"})
    signal.signal(signal.SIGTERM, lambda *_: pyfuse3.terminate())
    try:
        trio.run(pyfuse3.main)
    except KeyboardInterrupt:
        pass
    finally:
        pyfuse3.close(unmount=True)
    print(f"served {clock.served / 1e6:.1f} MB in {clock.busy_s:.1f} s of disk time at {a.read_mbps:g} MB/s")


if __name__ == "__main__":
    main()
