"""Expert store: read plans, byte-exact reads, the exact path vs a dequantized
fp32 reference, and I/O failures surfacing in the caller."""

from __future__ import annotations

import os
import shutil
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import mlx_edge0
from mlx_edge0.checkpoint import Edge0Section, expert_file, read_config
from mlx_edge0 import reads as reads_module
from mlx_edge0.store import ExpertReadError, ExpertStore, plan_reads
from mlx_edge0.tensorfile import TensorFileError
from mlx_edge0.streaming import StreamingMoE


def test_plan_reads_coalesces_adjacent_experts():
    offsets = [i * 100 for i in range(10)]
    runs = plan_reads([1, 2, 3, 5, 6, 9], offsets, stride=100, max_run=2)
    assert [(r.first_row, r.ids, r.offset) for r in runs] == [
        (0, (1, 2), 100),
        (2, (3,), 300),
        (3, (5, 6), 500),
        (5, (9,), 900),
    ]
    assert [r.ids for r in plan_reads([0, 1, 2], offsets, 100, 8)] == [(0, 1, 2)]
    assert plan_reads([], offsets, 100, 8) == []


def _store(path, io_threads=2, bypass_page_cache=False):
    section = Edge0Section.from_config(read_config(path))
    store = ExpertStore(path, section, io_threads=io_threads, bypass_page_cache=bypass_page_cache)
    return store, section


@pytest.mark.parametrize("bypass", [False, True], ids=["buffered", "bypass"])
@pytest.mark.parametrize("ids", [[0], [3, 4, 5, 6], [0, 2, 15], list(range(16))])
def test_read_is_byte_exact(converted, ids, bypass, monkeypatch):
    # a bounce buffer smaller than a coalesced run: chunks cross parts and experts
    monkeypatch.setattr(reads_module, "DIRECT_CHUNK", 3 * reads_module.DIRECT_BLOCK)
    path = converted("qwen3_moe").edge0
    store, section = _store(path, bypass_page_cache=bypass)
    layer = section.moe_layers[1]
    ref = mx.load(str(path / expert_file(layer)))
    for scales_dtype in (None, mx.float32):  # on-disk bf16, and widened by the I/O threads
        w = store.read(layer, ids, scales_dtype)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            p = getattr(w, proj)
            for part in ("weight", "scales", "biases"):
                want = mx.stack([ref[f"experts.{e}.{proj}.{part}"] for e in ids])
                if part != "weight" and scales_dtype is not None:
                    want = want.astype(scales_dtype)
                got = getattr(p, part)
                assert got.dtype == want.dtype and mx.array_equal(got, want).item(), (proj, part)
    store.telemetry.reset()
    store.read(layer, ids)
    assert store.telemetry.current.expert_loads == len(ids)
    # bytes from disk: the bundles, plus alignment padding inside coalesced runs
    bundle = section.experts.bundle_bytes
    stride = bundle + section.experts.pad_bytes(section.alignment)
    assert len(ids) * bundle <= store.telemetry.current.bytes_read <= len(ids) * stride
    store.close()


def _dequantized_reference(x, inds, scores, path, layer):
    """sum_k w_k * down(silu(gate x) * up x) with dense fp32 weights, in numpy."""
    ref = mx.load(str(path / expert_file(layer)))

    def dense(e, proj):
        return np.array(
            mx.dequantize(
                ref[f"experts.{e}.{proj}.weight"],
                ref[f"experts.{e}.{proj}.scales"].astype(mx.float32),
                ref[f"experts.{e}.{proj}.biases"].astype(mx.float32),
                group_size=64,
                bits=4,
            )
        )

    xs = np.array(x).reshape(-1, x.shape[-1]).astype(np.float64)
    inds = np.array(inds).reshape(xs.shape[0], -1)
    scores = np.array(scores.astype(mx.float32)).reshape(xs.shape[0], -1)
    out = np.zeros_like(xs)
    for t in range(xs.shape[0]):
        for e, s in zip(inds[t], scores[t]):
            g = dense(e, "gate_proj") @ xs[t]
            u = dense(e, "up_proj") @ xs[t]
            out[t] += s * (dense(e, "down_proj") @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "bailing_moe_v3"])
def test_exact_path_vs_dequantized_fp32(converted, family):
    path = converted(family).edge0
    model = mlx_edge0.load_model(path)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, StreamingMoE))
    mx.random.seed(0)
    x = mx.random.normal((2, 5, model.edge0_section.experts.hidden_size))
    inds, scores = block.route(block.router_logits(x))
    y = model.edge0_runtime.exact.experts(block.layer, x, inds)
    got = np.array((y * scores[..., None]).sum(axis=-2)).reshape(10, -1)
    want = _dequantized_reference(x, inds, scores, path, block.layer)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2
    assert rel < 1e-5  # only summation order differs from fp64 math


@pytest.mark.skipif(not reads_module.DIRECT_FLAG, reason="O_DIRECT is Linux's")
def test_direct_reads_land_any_range_in_any_views(tmp_path, monkeypatch):
    """Unaligned offsets and view sizes, chunks smaller than the range: the
    bytes are the file's, exactly, and a range past the end is a short read."""
    monkeypatch.setattr(reads_module, "DIRECT_CHUNK", 2 * reads_module.DIRECT_BLOCK)
    data = np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8)
    f = tmp_path / "bytes"
    f.write_bytes(data.tobytes())
    fd = reads_module.open_for_reads(f, bypass_page_cache=True)
    try:
        for offset, sizes in [(0, [4096]), (1, [3]), (4095, [2, 9000, 1]), (12345, [1, 1, 20000]), (40000, [10000])]:
            views = [memoryview(bytearray(n)) for n in sizes]
            assert reads_module._pread_direct(fd, views, offset, f) == sum(sizes)
            got = np.concatenate([np.frombuffer(v, np.uint8) for v in views])
            assert np.array_equal(got, data[offset : offset + sum(sizes)]), (offset, sizes)
        with pytest.raises(ExpertReadError, match=r"bytes: short read 5000/10001 bytes at offset 45000"):
            reads_module._pread_direct(fd, [memoryview(bytearray(10001))], 45000, f)
    finally:
        os.close(fd)


@pytest.mark.skipif(not reads_module.DIRECT_FLAG, reason="O_DIRECT is Linux's")
def test_direct_reads_of_whole_pages_land_in_place(tmp_path, monkeypatch):
    """Destinations that are whole pages at page-aligned addresses (slot
    buffer rows; the widening scratch) are filled by O_DIRECT itself, with no
    bounce buffer; scales are widened from the scratch; reading past the end
    of the file is a short read that names it."""
    from mlx_edge0.slots import PAGE, address, page_aligned_zeros

    def no_bounce(*args):
        raise AssertionError("went through the bounce buffer")

    monkeypatch.setattr(reads_module, "_pread_direct", no_bounce)
    data = np.random.default_rng(1).integers(0, 256, 10 * PAGE + 100, dtype=np.uint8)
    f = tmp_path / "bytes"
    f.write_bytes(data.tobytes())
    weight = page_aligned_zeros((2 * PAGE // 4,), mx.uint32)  # two pages of uint32
    scales = page_aligned_zeros((PAGE,), mx.float32)  # one page of bf16 on disk, widened
    views = [memoryview(a).cast("B") for a in (weight, scales)]
    assert all(address(v) % PAGE == 0 for v in views)
    fd = reads_module.open_for_reads(f, bypass_page_cache=True)
    try:
        parts = [(views[0], 2 * PAGE), (views[1], 2 * PAGE)]
        assert reads_module.read_run(fd, parts, PAGE, f, "BF16", "F32", False, True) == 4 * PAGE
        assert np.array_equal(np.array(weight).view(np.uint8), data[PAGE : 3 * PAGE])
        bf16 = data[3 * PAGE : 5 * PAGE].view(np.uint16).astype(np.uint32) << 16
        assert np.array_equal(np.array(scales).view(np.uint32), bf16)
        with pytest.raises(ExpertReadError, match=rf"bytes: short read {2 * PAGE + 100}/{4 * PAGE} bytes"):
            reads_module.read_run(fd, parts, 8 * PAGE, f, "BF16", "F32", False, True)
    finally:
        os.close(fd)


def test_slot_buffer_parts_start_on_a_page(converted):
    from mlx_edge0.slots import PAGE, SlotBuffers, address

    store, _ = _store(converted("qwen3_moe").edge0)
    try:
        for capacity in (1, 3):
            buffers = SlotBuffers(store.geometry, capacity, mx.float32)
            assert all(address(memoryview(a).cast("B")) % PAGE == 0 for a in buffers.arrays)
            assert [a.shape[0] for a in buffers.arrays] == [capacity] * 9
    finally:
        store.close()


def test_bypass_opens_every_layer_file_uncached(converted):
    store, section = _store(converted("qwen3_moe").edge0, bypass_page_cache=True)
    try:
        if reads_module.DIRECT_FLAG:
            import fcntl

            for lf in store.layers.values():
                assert fcntl.fcntl(lf.fd, fcntl.F_GETFL) & reads_module.DIRECT_FLAG
    finally:
        store.close()


def test_filesystem_without_direct_reads_fails_at_load_naming_the_file(converted, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & reads_module.DIRECT_FLAG:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(reads_module, "DIRECT_FLAG", os.O_DIRECT if hasattr(os, "O_DIRECT") else 0x4000)
    monkeypatch.setattr(os, "open", no_direct)
    path = converted("qwen3_moe").edge0
    with pytest.raises(
        TensorFileError,
        match=r"layer_\d+\.safetensors: cannot open for direct reads "
        r"\(O_DIRECT: Invalid argument\)",
    ):
        mlx_edge0.load_model(path, page_cache="bypass")


@pytest.mark.parametrize("bypass", [False, True], ids=["buffered", "bypass"])
def test_truncated_file_during_reads_raises_in_caller(converted, tmp_path, bypass):
    src = converted("qwen3_moe").edge0
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    store, section = _store(path, bypass_page_cache=bypass)
    layer = section.moe_layers[0]
    f = path / expert_file(layer)
    os.truncate(f, f.stat().st_size // 2)
    t0 = time.monotonic()
    with pytest.raises(ExpertReadError, match=r"layer_001\.safetensors: short read"):
        store.read(layer, list(range(16)))
    assert time.monotonic() - t0 < 10
    # the store stays usable for reads that are still in the file
    w = store.read(layer, [0])
    assert w.num_experts == 1
    store.close()


def test_on_demand_read_does_not_queue_behind_read_ahead(converted, monkeypatch):
    """A prerouted step issues hundreds of read-ahead reads at once; an
    on-demand read in the same step must not wait for them."""
    from mlx_edge0.slots import SlotBuffers

    store, section = _store(converted("qwen3_moe").edge0, io_threads=1)
    release = threading.Event()
    order = []
    preadv = os.preadv

    def gated(fd, views, offset):
        if threading.current_thread().name.startswith("edge0-io_"):  # the read-ahead threads
            release.wait(10)
        order.append(threading.current_thread().name.split("_")[0])
        return preadv(fd, views, offset)

    monkeypatch.setattr(os, "preadv", gated)
    first, second = section.moe_layers[:2]
    ahead = store.submit(first, [0, 5], [0, 1], SlotBuffers(section.experts, 2, None))
    t0 = time.perf_counter()
    w = store.read(second, [3])
    waited = time.perf_counter() - t0
    release.set()
    ahead.wait()
    assert waited < 5 and order[0] == "edge0-io-urgent", (waited, order)
    ref = mx.load(str(converted("qwen3_moe").edge0 / expert_file(second)))
    assert mx.array_equal(w.down_proj.weight[0], ref["experts.3.down_proj.weight"]).item()
    store.close()


def test_queued_reads_run_one_at_a_time_in_order_and_cancel_until_started(converted, monkeypatch):
    """:meth:`ExpertStore.queue_reads`: one thread of their own, in the order
    given; a read cancelled before it starts never writes its row, the rest
    land byte for byte."""
    from mlx_edge0.slots import SlotBuffers

    store, section = _store(converted("qwen3_moe").edge0)
    release = threading.Event()
    started = []
    preadv = os.preadv

    def gated(fd, views, offset):
        if threading.current_thread().name.startswith("edge0-io-queue"):
            started.append(offset)
            release.wait(10)
        return preadv(fd, views, offset)

    monkeypatch.setattr(os, "preadv", gated)
    layer = section.moe_layers[0]
    rows = SlotBuffers(section.experts, 4, None)
    batches = store.queue_reads(layer, [6, 2, 7, 1], [0, 1, 2, 3], rows)
    for _ in range(500):  # the first read starts, then holds the only queue thread
        if started:
            break
        time.sleep(0.01)
    cancelled = [b.cancel() for b in batches]
    release.set()
    batches[0].wait()
    assert cancelled == [False, True, True, True] and len(started) == 1
    ref = mx.load(str(converted("qwen3_moe").edge0 / expert_file(layer)))
    weights = rows.weights()
    assert mx.array_equal(weights.down_proj.weight[0], ref["experts.6.down_proj.weight"]).item()
    assert not mx.any(weights.down_proj.weight[1:]).item()  # never written: still the zeros they began as
    store.close()


def test_io_error_in_worker_raises_in_caller(converted, monkeypatch):
    store, section = _store(converted("qwen3_moe").edge0)

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    with pytest.raises(ExpertReadError, match="Input/output error"):
        store.read(section.moe_layers[0], [1, 2])
    store.close()
