"""Fuzzing the safetensors header parser: random bytes, random JSON headers
and mutations of real headers either parse into entries that lie inside the
file, or fail with :class:`TensorFileError` naming the file; nothing else is
raised, and no read goes past the end of the file."""

from __future__ import annotations

import io
import json
import struct
import tempfile
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mlx_edge0 import tensorfile
from mlx_edge0.tensorfile import DTYPES, TensorFileError, nbytes_of, read_header

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


class TrackedFile(io.FileIO):
    """A file that records how far any read reached."""

    furthest = 0

    def read(self, size=-1):
        data = super().read(size)
        TrackedFile.furthest = max(TrackedFile.furthest, self.tell())
        return data


def _tracked_open(path, mode="r", *args, **kwargs):
    assert mode == "rb"
    return TrackedFile(path, "r")


def parse(data: bytes):
    """read_header on ``data`` as a file: the header, or the TensorFileError."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.safetensors"
        path.write_bytes(data)
        TrackedFile.furthest = 0
        with mock.patch.object(tensorfile, "open", _tracked_open, create=True):
            try:
                header = read_header(path)
            except TensorFileError as e:
                assert str(e).startswith(f"{path}: ")
                return e
        assert TrackedFile.furthest <= len(data)
    _check_inside(header, len(data))
    return header


def _check_inside(header, size: int) -> None:
    assert 8 <= header.data_start <= size and header.file_size == size
    last_end = header.data_start
    for e in header.entries.values():  # sorted by offset, non-overlapping, each in the file
        assert last_end <= e.start <= e.end <= size
        assert e.end - e.start == nbytes_of(e.dtype, e.shape)
        last_end = e.end


def with_length(raw: bytes, tail: bytes = b"") -> bytes:
    return struct.pack("<Q", len(raw)) + raw + tail


@pytest.fixture(scope="module")
def real() -> bytes:
    """A real safetensors file (written by MLX), a few small tensors."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "real.safetensors"
        mx.save_safetensors(
            str(path),
            {
                "a.weight": mx.arange(24, dtype=mx.uint32).reshape(4, 6),
                "a.scales": mx.ones((4, 2), mx.bfloat16),
                "b": mx.zeros((3,), mx.float32),
            },
            metadata={"format": "mlx"},
        )
        data = path.read_bytes()
    assert isinstance(parse(data), tensorfile.TensorHeader)
    return data


@FUZZ
@given(st.binary(max_size=512))
@example(b"")
@example(struct.pack("<Q", 2**64 - 1))
@example(with_length(b"[" * 5000))  # nesting deeper than Python's recursion limit
@example(with_length(b'{"a": ' + b"1" * 5000 + b"}"))  # an integer too long to convert
@example(with_length(b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1e400]}}', b"x"))
def test_random_bytes(data):
    parse(data)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
ENTRY = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*DTYPES, "F64", "", "u8"]) | JSON,
        "shape": st.lists(st.integers(-2, 64), max_size=3) | JSON,
        "data_offsets": st.lists(st.integers(-8, 4096), min_size=2, max_size=2) | JSON,
    }
)


@FUZZ
@given(
    st.dictionaries(st.text(max_size=6), ENTRY | JSON, max_size=5),
    st.integers(0, 4096),
    st.sampled_from(["exact", "short", "long"]),
)
def test_random_headers(header, data_bytes, length_field):
    raw = json.dumps(header, allow_nan=True).encode()
    n = {"exact": len(raw), "short": len(raw) // 2, "long": len(raw) + data_bytes + 1}[length_field]
    parse(struct.pack("<Q", n) + raw + bytes(data_bytes))


@FUZZ
@given(st.data())
def test_mutated_real_headers(real, data):
    (n,) = struct.unpack("<Q", real[:8])
    header = json.loads(real[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "metadata"]))
    if field == "entry":
        header[name] = data.draw(JSON)
    elif field == "metadata":
        header["__metadata__"] = data.draw(JSON)
    elif field == "data_offsets":
        a, b = header[name]["data_offsets"]
        delta = data.draw(st.integers(-64, 64) | st.sampled_from([2**63, -(2**63), 2**64]))
        header[name]["data_offsets"] = data.draw(
            st.sampled_from([[a + delta, b], [a, b + delta], [a + delta, b + delta]])
        )
    else:
        header[name][field] = data.draw(ENTRY)[field]
    raw = json.dumps(header).encode()
    tail = real[8 + n :]
    cut = data.draw(st.integers(0, len(tail)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) + 7), st.integers(0, 255)), max_size=3))
    out = bytearray(struct.pack("<Q", len(raw)) + raw + tail[:cut])
    for i, byte in flips:
        out[i] = byte
    parse(bytes(out))
