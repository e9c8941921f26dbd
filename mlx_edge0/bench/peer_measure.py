"""One measurement of the peer arm (llama.cpp, :mod:`mlx_edge0.bench.llamacpp`)
in the bench's child process: the same prompt and teacher-forced decode as
every MLX arm's (:mod:`mlx_edge0.bench.measure`), timed the same way."""

from __future__ import annotations

import os
import time

from .arms import PEER_ARMS
from .run_spec import (
    WARMUP_STEPS,
    RunSpec,
    checkpoint_files,
    device_read_bytes,
    drop_page_cache,
    forced_tokens,
    peak_rss_bytes,
)


def measure_llamacpp(spec: RunSpec) -> dict:
    """The peer arm: llama.cpp on the GGUF at ``spec.path``, the same prompt as
    the other arms, then a teacher-forced decode of :func:`forced_tokens`, as
    every arm's (``tokens`` are llama.cpp's argmax at each position, not what
    it was fed). There is no MLX memory: ``peak_rss`` counts llama.cpp's
    buffers and the mmap'd weights it touched."""
    import numpy as np

    from mlx_edge0.options import available_memory

    from .llamacpp import LlamaCppModel, llama_cpp_version

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    record = {
        "arm": spec.arm,
        "ok": True,
        "available_memory_at_start": available_memory(),
        "loadavg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "llama_cpp_python": llama_cpp_version(),
        "n_threads": threads,
        "load_mode": PEER_ARMS[spec.arm],
        "teacher_forced": True,
    }
    n_ctx = 2 * spec.prompt_tokens + WARMUP_STEPS + spec.decode_tokens
    start = time.perf_counter()
    model = LlamaCppModel(spec.path, load_mode=PEER_ARMS[spec.arm], n_threads=threads, n_ctx=n_ctx)
    record["load_s"] = time.perf_counter() - start
    record["model_bytes"] = model.model_bytes()
    vocab = model.n_vocab

    def request(seed: int) -> tuple[float, np.ndarray]:
        prompt = np.random.default_rng(seed).integers(0, vocab, spec.prompt_tokens).tolist()
        model.reset()
        t0 = time.perf_counter()
        logits = model.forward(prompt)
        return time.perf_counter() - t0, logits

    prefill_s, logits = request(spec.seed)
    record.update(
        prefill_s=prefill_s, prefill_tok_s=spec.prompt_tokens / prefill_s, ttft_s=prefill_s,
        ttft_with_load_s=record["load_s"] + prefill_s, logits_finite=bool(np.isfinite(logits).all()),
    )  # fmt: skip
    tokens = [int(logits.argmax())]
    fed = forced_tokens(vocab, WARMUP_STEPS + spec.decode_tokens, spec.seed)
    for token in fed[:WARMUP_STEPS]:
        tokens.append(int(model.forward([token]).argmax()))
    evict = checkpoint_files(spec.path) if spec.evict_between_steps else []
    steps = []
    device_before = device_read_bytes()
    for token in fed[WARMUP_STEPS:]:
        if evict:
            drop_page_cache(evict)
        t0 = time.perf_counter()
        tokens.append(int(model.forward([token]).argmax()))
        steps.append(time.perf_counter() - t0)
    decode_s = sum(steps)
    record["device_bytes_per_token"] = (device_read_bytes() - device_before) / spec.decode_tokens
    record.update(
        decode_s=decode_s, decode_tok_s=spec.decode_tokens / decode_s,
        decode_s_per_token=decode_s / spec.decode_tokens, decode_step_s=steps,
        evicted_between_steps=bool(evict), profiled=False, fed_tokens=fed,
    )  # fmt: skip
    if spec.warm_prefill:
        warm_s, _ = request(spec.seed + 1)
        record.update(warm_prefill_s=warm_s, warm_prefill_tok_s=spec.prompt_tokens / warm_s, warm_ttft_s=warm_s)
    model.close()
    record["peak_rss"] = peak_rss_bytes()
    record["tokens"] = tokens
    return record
