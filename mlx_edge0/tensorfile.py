"""Safetensors files read and written by byte range, without trusting them.

Readers validate a header completely (length, JSON, dtypes, shapes, every offset
inside the file, no overlaps) before a single tensor byte is read, so a corrupt
or truncated file fails here with its name and the problem, never deep inside
MLX. The writer streams tensors in a planned order, so a multi-gigabyte file is
written with one tensor in memory at a time, and it can align the data section
for direct reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import mlx.core as mx
import numpy as np

MAX_HEADER_BYTES = 256 * 1024 * 1024

DTYPES: dict[str, tuple[mx.Dtype, int]] = {
    "U8": (mx.uint8, 1),
    "I8": (mx.int8, 1),
    "U16": (mx.uint16, 2),
    "I16": (mx.int16, 2),
    "U32": (mx.uint32, 4),
    "I32": (mx.int32, 4),
    "U64": (mx.uint64, 8),
    "I64": (mx.int64, 8),
    "F16": (mx.float16, 2),
    "BF16": (mx.bfloat16, 2),
    "F32": (mx.float32, 4),
    "BOOL": (mx.bool_, 1),
}
MX_TO_CODE = {v[0]: k for k, v in DTYPES.items()}
# (tensor name, first row, end row) -> those rows of it, or None: not readable that way
RowReader = Callable[[str, int, int], Optional[mx.array]]


class TensorFileError(ValueError):
    """A safetensors file is missing, truncated or inconsistent."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: absolute byte range [start, end) in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def mx_dtype(self) -> mx.Dtype:
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class TensorHeader:
    """A validated header: entries sorted by offset, plus free-form metadata."""

    path: Path
    file_size: int
    data_start: int
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]


def dtype_code(dtype: mx.Dtype) -> str:
    try:
        return MX_TO_CODE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors") from None


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    return math.prod(shape) * DTYPES[dtype][1]


def read_header(path: Path | str) -> TensorHeader:
    """Parse and validate a safetensors header.

    Raises:
        TensorFileError: naming ``path`` and what is wrong with it.
    """
    path = Path(path)

    def fail(problem: str) -> TensorFileError:
        return TensorFileError(f"{path}: {problem}")

    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise fail(f"file is {file_size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > file_size - 8 or header_len > MAX_HEADER_BYTES:
                raise fail(
                    f"header length {header_len} runs past the end of the file "
                    f"({file_size} bytes); the file is truncated or not safetensors"
                )
            raw = f.read(header_len)
    except FileNotFoundError:
        raise TensorFileError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise TensorFileError(f"{path}: is a directory, not a safetensors file") from None
    except OSError as e:  # permissions, I/O errors
        raise TensorFileError(f"{path}: cannot be read ({e.strerror or e})") from None

    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, a huge integer, deep nesting
        raise fail(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object")

    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise fail("__metadata__ is not a JSON object")

    entries = {}
    for name, info in header.items():
        entries[name] = _parse_entry(name, info, data_start, file_size, fail)

    ordered = sorted(entries.values(), key=lambda e: (e.start, e.end))
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.start < prev.end:
            raise fail(f"tensors {prev.name!r} and {cur.name!r} overlap")
    return TensorHeader(
        path=path,
        file_size=file_size,
        data_start=data_start,
        entries={e.name: e for e in ordered},
        metadata={str(k): str(v) for k, v in metadata.items()},
    )


def _parse_entry(name, info, data_start, file_size, fail) -> TensorEntry:
    if not isinstance(info, dict):
        raise fail(f"entry {name!r} is not a JSON object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise fail(f"tensor {name!r} has unsupported dtype {dtype!r}")
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise fail(f"tensor {name!r} has an invalid shape {shape!r}")
    offsets = info.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise fail(f"tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise fail(f"tensor {name!r} has data_offsets {offsets} out of order")
    if end - begin != nbytes_of(dtype, shape):
        raise fail(
            f"tensor {name!r}: data_offsets span {end - begin} bytes but {dtype}{shape} needs {nbytes_of(dtype, shape)}"
        )
    if data_start + end > file_size:
        raise fail(
            f"tensor {name!r} ends at byte {data_start + end}, past the end of the "
            f"file ({file_size} bytes); the file is truncated"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def row_reader(path: Path | str) -> RowReader:
    """``read(name, start, end)``: rows ``[start, end)`` (axis 0) of tensor
    ``name`` of the file, read alone (one ``pread``; the rows of a row-major
    tensor are one byte range), or None when the file has no such tensor."""
    path = Path(path)
    header = read_header(path)

    def read(name: str, start: int, end: int) -> Optional[mx.array]:
        entry = header.entries.get(name)
        if entry is None or not entry.shape or not 0 <= start <= end <= entry.shape[0]:
            return None
        row = nbytes_of(entry.dtype, entry.shape[1:])
        size = DTYPES[entry.dtype][1]
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), (end - start) * row, entry.start + start * row)
        if len(data) != (end - start) * row:
            raise TensorFileError(f"{path}: short read of tensor {name!r} (the file is truncated)")
        bits = np.frombuffer(data, {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
        return mx.array(bits.reshape(end - start, *entry.shape[1:])).view(entry.mx_dtype)

    return read


def tensors_sha256(path: Path | str, names: Iterable[str]) -> str:
    """SHA-256 over the tensors ``names`` of the safetensors file ``path``, in
    that order, each as its name (UTF-8) then its data bytes; names the file
    does not hold are skipped. Ties a derived file (heads, adapters) to the
    exact weights it was made for."""
    header = read_header(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for name in names:
            entry = header.entries.get(name)
            if entry is None:
                continue
            f.seek(entry.start)
            digest.update(name.encode())
            digest.update(f.read(entry.nbytes))
    return digest.hexdigest()


def array_bytes(a: mx.array) -> memoryview:
    """The raw bytes of an evaluated array (made contiguous first)."""
    a = mx.contiguous(a)
    mx.eval(a)
    return memoryview(a).cast("B")


class TensorWriter:
    """Streams a safetensors file whose layout is fixed up front.

    Args:
        path: file to create (the caller makes the directory atomic).
        entries: ``(name, dtype_code, shape)`` in the order the data is written.
        metadata: string metadata stored in ``__metadata__``.
        alignment: the data section starts at a multiple of this many bytes.

    ``sha256`` is the digest of the bytes written, hashed on the way (a
    checksum without reading a multi-gigabyte file back).
    """

    def __init__(
        self,
        path: Path | str,
        entries: list[tuple[str, str, tuple[int, ...]]],
        metadata: Optional[dict[str, str]] = None,
        alignment: int = 8,
    ):
        self.path = Path(path)
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._plan = []
        for name, dtype, shape in entries:
            n = nbytes_of(dtype, shape)
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self._plan.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        pad = (-(8 + len(raw))) % alignment
        raw += b" " * pad
        self.data_start = 8 + len(raw)
        self.data_bytes = offset
        self._next = 0
        self._digest = hashlib.sha256()
        self._file = open(self.path, "wb")
        self._emit(struct.pack("<Q", len(raw)))
        self._emit(raw)

    def _emit(self, buf: bytes | memoryview) -> None:
        self._file.write(buf)
        self._digest.update(buf)

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of everything written so far (the whole file once closed)."""
        return self._digest.hexdigest()

    def write(self, name: str, data: mx.array | np.ndarray | bytes | memoryview) -> None:
        """Write the next planned tensor."""
        if self._next >= len(self._plan):
            raise ValueError(f"{self.path}: unexpected tensor {name!r}, all written")
        want, n = self._plan[self._next]
        if name != want:
            raise ValueError(f"{self.path}: expected tensor {want!r} next, got {name!r}")
        if isinstance(data, mx.array):
            buf = array_bytes(data)
        elif isinstance(data, np.ndarray):
            buf = memoryview(np.ascontiguousarray(data)).cast("B")
        else:
            buf = memoryview(data).cast("B")
        if buf.nbytes != n:
            raise ValueError(f"{self.path}: tensor {name!r} is {buf.nbytes} bytes, planned {n}")
        self._emit(buf)
        self._next += 1

    def close(self) -> None:
        """Finish the file; it must hold every planned tensor."""
        if self._file.closed:
            return
        try:
            if self._next != len(self._plan):
                missing = self._plan[self._next][0]
                raise ValueError(f"{self.path}: closed before tensor {missing!r} was written")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def __enter__(self) -> "TensorWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
