"""One measurement in one fresh process: load an arm, prefill, decode, report.

Run as ``python -m mlx_edge0.bench.measure --arm ARM --path CKPT ...``; prints
one JSON line. The parent (:mod:`mlx_edge0.bench.runner`) owns the page cache
before the start, arm order and aggregation; this side owns everything that
happens inside the process, so one arm's weights, allocator state and peak
counters never leak into the next.

What one run does, in order: load; the *cold* request (prefill of a seeded
random prompt and its first token, the first request after process start);
two warm-up decode steps; the timed decode steps (per-step time and, for
edge0, per-step counters); optionally a *warm* request (a second prompt of the
same length, fresh KV cache, same process).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from pathlib import Path
from typing import Optional

from .arms import is_peer_arm, parse_arm
from .decode_loop import pipelined_steps
from .peer_measure import measure_llamacpp
from .run_spec import (
    DTYPES,
    WARMUP_STEPS,
    RunSpec,
    checkpoint_files,
    device_read_bytes,
    drop_page_cache,
    forced_tokens,
    peak_rss_bytes,
)

PROFILE_TOP = 15
# Counters kept per decode step (differences of the model's summed counters).
STEP_COUNTERS = (
    "exposed_wait_ms", "prerouted_wait_ms", "expert_loads", "bytes_read", "reads", "hot_hits", "hot_misses",
    "staged_kept", "staged_copied", "staged_read", "prerouted",
)  # fmt: skip


def _load(arm: str, path: Path, dtype: str, k: int = 0):
    import mlx.core as mx

    base, options = parse_arm(arm)
    if base == "stock":
        from mlx_lm.utils import load_model

        model, _ = load_model(path)
        if dtype != "native":
            model.set_dtype(getattr(mx, dtype))
            mx.eval(model.parameters())
        return model
    from mlx_edge0 import load_model

    model = load_model(path, compute_dtype=dtype, **options, **({"k": k} if k else {}))
    model.limit_buffer_cache()  # the child runs this arm alone
    mx.eval(model.parameters())
    return model


def _vocab_size(path: Path) -> int:
    from mlx_edge0.checkpoint import read_config, text_config

    return text_config(read_config(path))["vocab_size"]


def _counters(model) -> Optional[dict]:
    """The summed counters of an edge0 model (the telemetry's ``Stats``; None for stock)."""
    if not hasattr(model, "stats"):
        return None
    from mlx_edge0.telemetry import Stats

    counters = Stats().as_dict()
    return {k: v for k, v in model.stats().items() if k in counters}


def _reset_counters(model) -> None:
    if hasattr(model, "reset_stats"):
        model.reset_stats()


def _decode_trace(layers: list[int], steps: list[list[tuple[int, list[int]]]], num_experts: int, k: int):
    """The decoded tokens' routing (each step's recorded ``(layer, ids)`` calls, batch 1)."""
    from .locality import RoutingTrace

    tokens = []
    for calls in steps:
        routed = dict(calls)  # a prerouted step records its consumers first: order by layer
        tokens.append(tuple(routed.get(layer, ()) for layer in layers))
    return RoutingTrace(tuple(layers), num_experts, k, tuple(tokens))


# The runtime's policies, Belady's MIN, and LFU sparing the next token's routing
# (a perfect prerouter's knowledge, which the runtime does not use yet).
REPLAYED_POLICIES = ("lfu", "lru", "min", "lfu+next")


def _eviction_replay(
    trace,
    capacity: int,
    permanent: frozenset,
    resident: list,
    waited: frozenset,
    planned: frozenset,
    prior: dict,
    policy_state: dict,
) -> dict:
    """The decode trace replayed through a cache of the run's hot capacity
    (rows) under :data:`REPLAYED_POLICIES`: how far the policy
    is from the optimum on exactly this routing and budget. Twice: from a
    cache empty but for its permanent bundles, and (``from_start``) from
    what the runtime's cache held when the timed decode began (``resident``:
    filled by the prompt and warm-up steps), the state the runtime's own hit
    rate starts from. LFU weighs the ``waited`` bundles, places the
    ``planned`` layers' when each step opens and starts from the routing
    profile's counts (``prior``), as the runtime's does. The record keeps
    whether there were any (``popularity_prior``), not the counts: an offline
    replay recomputes them from the checkpoint's profile. From the start, the
    runtime's kind of policy starts from what the runtime's had learned then
    (``policy_state``, kept as ``policy_at_start``: the prompt's and warm-up's
    uses too), so its replay is what the runtime served."""
    from .eviction import ceiling, compare

    out = {
        "capacity": capacity,
        "permanent": len(permanent),
        "routings_per_token": trace.routings / max(1, len(trace.tokens)),
        # the keys themselves, so the record replays offline from the same start
        "permanent_keys": sorted(permanent),
        "resident_keys": list(resident),
        "waited_keys": sorted(waited),
        "planned_layers": sorted(planned),
        "popularity_prior": bool(prior),
        "policy_at_start": policy_state,
    }
    replayed = {"permanent": permanent, "waited": waited, "planned": planned, "prior": prior or None}
    results = compare(trace, [capacity], REPLAYED_POLICIES, **replayed)
    if results:  # none when a routed set is bigger than the cache (the runtime bypasses it then)
        out.update(hit_rate={r.policy: r.hit_rate for r in results}, ceiling=ceiling(trace, permanent))
        started = compare(
            trace, [capacity], REPLAYED_POLICIES, resident=resident, policy_state=policy_state, **replayed
        )
        out["from_start"] = {
            "resident": len(set(resident) - permanent),
            "hit_rate": {r.policy: r.hit_rate for r in started},
            "ceiling": ceiling(trace, permanent, resident),
        }
    return out


def _profile_top(profile: cProfile.Profile, tokens: int) -> list[dict]:
    """The functions with the most own time, in ms per decoded token."""
    rows = []
    for (file, line, func), (_, calls, own, total, _) in pstats.Stats(profile).stats.items():
        where = func if file == "~" else f"{Path(file).name}:{line}({func})"
        rows.append(
            {
                "function": where,
                "calls_per_token": calls / tokens,
                "own_ms_per_token": own * 1e3 / tokens,
                "total_ms_per_token": total * 1e3 / tokens,
            }
        )
    return sorted(rows, key=lambda r: -r["own_ms_per_token"])[:PROFILE_TOP]


def measure(spec: RunSpec) -> dict:
    """Load, cold request, warm-up, timed decode, optional warm request.

    The decode is teacher-forced, as the peer arm's is: each step feeds the
    next token of :func:`forced_tokens`, so every arm routes the same token
    sequence whatever it predicts (random weights loop under greedy decoding,
    onto the same experts); ``tokens`` are each step's argmax, comparable
    position by position across arms.

    The warm-up and timed steps run as mlx-lm's ``generate_step`` runs them
    (:func:`~.decode_loop.pipelined_steps`): step t+1's graph is built and
    queued (``async_eval``) before step t's token is read back, so the
    host's work for t+1 (a prerouted step's fills start when it opens)
    overlaps step t's compute; the timed window runs from the last warm-up
    token's read-back to the last timed token's, and its counters, device
    bytes and routing cover the N steps built in it. The fed token is made
    to depend on step t's output (``mx.depends``), so step t+1 waits for step
    t's token exactly as a sampled one would."""
    if is_peer_arm(spec.arm):
        return measure_llamacpp(spec)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_edge0.options import available_memory

    record = {
        "arm": spec.arm,
        "ok": True,
        "available_memory_at_start": available_memory(),
        "loadavg_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "teacher_forced": True,
    }
    mx.reset_peak_memory()
    start = time.perf_counter()
    model = _load(spec.arm, spec.path, spec.dtype, spec.k)
    record["load_s"] = time.perf_counter() - start
    record["active_memory_after_load"] = mx.get_active_memory()
    record["load_peak_memory"] = mx.get_peak_memory()
    vocab = _vocab_size(spec.path)

    def request(seed: int) -> tuple[float, mx.array, list, bool]:
        """Prefill a seeded random prompt; time until its first token."""
        rng = np.random.default_rng(seed)
        prompt = mx.array(rng.integers(0, vocab, spec.prompt_tokens), mx.int32)
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(prompt[None], cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1)
        mx.eval(y, logits)
        return time.perf_counter() - t0, y, cache, bool(mx.all(mx.isfinite(logits)).item())

    mx.reset_peak_memory()
    _reset_counters(model)
    prefill_s, y, cache, record["logits_finite"] = request(spec.seed)
    record.update(
        prefill_s=prefill_s,
        prefill_tok_s=spec.prompt_tokens / prefill_s,
        ttft_s=prefill_s,
        ttft_with_load_s=record["load_s"] + prefill_s,
    )
    record["prefill_counters"] = _counters(model)
    tokens = [y.item()]
    # one step more than read back: the one queued after the last timed token
    fed = forced_tokens(vocab, WARMUP_STEPS + spec.decode_tokens + 1, spec.seed)
    feed = iter(fed)

    def forward(y: mx.array) -> mx.array:
        """Build the next step's graph: the next fed token, after ``y``."""
        fed_token = mx.depends(mx.array([[next(feed)]], mx.int32), y)
        return mx.argmax(model(fed_token, cache=cache)[:, -1, :], axis=-1)

    evict = checkpoint_files(spec.path) if spec.evict_between_steps else []
    profile = cProfile.Profile() if spec.profile else None
    telemetry = model.edge0_runtime.telemetry if hasattr(model, "edge0_runtime") else None
    routed_steps: list[list[tuple[int, list[int]]]] = []
    hot = model.edge0_runtime.hot if hasattr(model, "edge0_runtime") else None
    start: dict = {}

    def begin_timed() -> None:
        """What the timed window counts starts here, as it opens."""
        record["prefill_peak_memory"] = mx.get_peak_memory()
        _reset_counters(model)  # also resets MLX's peak: the decode peak is decode's alone
        mx.reset_peak_memory()
        start["counters"] = _counters(model)
        start["resident"] = [] if hot is None else list(hot.row_of)  # filled by the prompt and warm-up
        start["policy"] = None if hot is None else hot.policy.state()  # and what it learned from them
        if hot is not None:
            record["held_at_decode_start"] = len(hot.held)  # released to the policy since: held_released
        start["device"] = device_read_bytes()
        if profile:
            profile.enable()

    def queue(y: mx.array, in_window: bool) -> mx.array:
        """Build the next step's graph after ``y`` and start computing it."""
        if in_window and telemetry is not None:  # the host routes a step while building it
            telemetry.routing_trace = []
            routed_steps.append(telemetry.routing_trace)
        if in_window and evict:
            drop_page_cache(evict)
        queued = forward(y)
        mx.async_eval(queued)
        return queued

    steps, per_step, t0 = [], [], time.perf_counter()
    for i, token in pipelined_steps(y, queue, WARMUP_STEPS, spec.decode_tokens, begin_timed):
        tokens.append(token)
        now = time.perf_counter()
        if i >= WARMUP_STEPS:  # the interval holds the next step's build
            steps.append(now - t0)
            before, after = start["counters"], _counters(model)
            if after is not None:
                per_step.append({k: after.get(k, 0) - before.get(k, 0) for k in STEP_COUNTERS})
            start["counters"] = after
        t0 = now
    if profile:
        profile.disable()
    if telemetry is not None:
        telemetry.routing_trace = None
    record["decode_peak_memory"] = mx.get_peak_memory()
    record["device_bytes_per_token"] = (device_read_bytes() - start["device"]) / spec.decode_tokens
    decode_counters = _counters(model)
    if telemetry is not None:
        from .locality import LocalitySummary

        section = model.edge0_section
        trace = _decode_trace(
            list(section.moe_layers), routed_steps, section.experts.num_experts, section.num_experts_per_tok
        )
        record["locality"] = LocalitySummary.of(trace).as_dict()
        record["routing"] = trace.as_dict()  # RoutingTrace(**routing): replay any policy later
        if hot is not None:
            prerouting = model.edge0_runtime.prerouting
            planned = prerouting.cache_planned_layers if prerouting is not None else frozenset()
            record["eviction_replay"] = _eviction_replay(
                trace,
                hot.capacity,
                frozenset(hot.permanent),
                start["resident"],
                frozenset(hot.waited),
                planned,
                hot.prior,
                start["policy"],
            )

    decode_s = sum(steps)
    record.update(
        decode_s=decode_s, decode_tok_s=spec.decode_tokens / decode_s,
        decode_s_per_token=decode_s / spec.decode_tokens, decode_step_s=steps,
        evicted_between_steps=bool(evict), profiled=bool(profile), fed_tokens=fed,
    )  # fmt: skip
    if profile:
        record["profile_top"] = _profile_top(profile, spec.decode_tokens)
    if decode_counters is not None:
        final = model.stats()
        record["resident_bytes"], record["staged_window"] = final["resident_bytes"], final["staged_window"]
        record["decode_counters"] = decode_counters
        record["decode_step_counters"] = per_step
        # step_ms sums closed steps only (the last one is still open), so per token it reads one
        # step short; a token's wall time is decode_s_per_token
        record["counters_per_token"] = {k: v / spec.decode_tokens for k, v in decode_counters.items() if k != "step_ms"}
    if spec.warm_prefill:
        cache = y = None  # the first request's state is released, as a finished request's is
        mx.reset_peak_memory()
        warm_s, _, cache, _ = request(spec.seed + 1)
        record.update(
            warm_prefill_s=warm_s,
            warm_prefill_tok_s=spec.prompt_tokens / warm_s,
            warm_ttft_s=warm_s,
            warm_prefill_peak_memory=mx.get_peak_memory(),
        )
    peaks = ("load_peak_memory", "prefill_peak_memory", "decode_peak_memory", "warm_prefill_peak_memory")
    record["generate_peak_memory"] = max(record.get(k, 0) for k in peaks[1:])
    record["peak_memory"] = max(record.get(k, 0) for k in peaks)
    record["peak_rss"] = peak_rss_bytes()
    record["tokens"] = tokens
    return record


def main(argv: Optional[list[str]] = None) -> None:
    """Child mode: measure one arm and print one JSON line."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--arm", required=True, help="an arm name; hot/staged/prerouter may add @GiB")
    p.add_argument("--path", type=Path, required=True)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=0)
    p.add_argument("--warm-prefill", action="store_true")
    p.add_argument("--evict-between-steps", action="store_true")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    spec = RunSpec(a.arm, a.path, a.prompt_tokens, a.decode_tokens, a.dtype, a.seed, a.k,
                   a.warm_prefill, a.evict_between_steps, a.profile)  # fmt: skip
    print(json.dumps(measure(spec)), flush=True)


if __name__ == "__main__":
    main()
