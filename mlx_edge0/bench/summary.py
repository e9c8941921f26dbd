"""A bench's runs summarized: per arm and cache state, the median and range of
every figure, paired ratios within each round, and the figures derived from
each run's counters (:func:`run_metrics`). Pure functions of the run records,
so a results file summarizes again offline (the sweep, the reports)."""

from __future__ import annotations

import statistics

from ..telemetry import hot_hit_rate
from .arms import is_peer_arm


def run_metrics(r: dict) -> dict:
    """Per-run figures derived from a child's record (edge0 counters where present)."""
    m = {}
    c = r.get("counters_per_token")
    if c:
        loads = c.get("expert_loads", 0)
        staged = c.get("staged_kept", 0) + c.get("staged_copied", 0) + c.get("staged_read", 0)
        m["exposed_wait_ms_per_step"] = c.get("exposed_wait_ms", 0.0)
        m["loads_per_token"] = loads
        m["bytes_per_token"] = c.get("bytes_read", 0)
        if loads:
            m["mib_per_load"] = c.get("bytes_read", 0) / loads / 2**20
        if (rate := hot_hit_rate(c)) is not None:
            m["hot_hit_rate"] = rate
        if staged:
            m["staged_hit_rate"] = (staged - c.get("staged_read", 0)) / staged
    if "device_bytes_per_token" in r:
        m["device_bytes_per_token"] = r["device_bytes_per_token"]
    if "staged_window" in r:  # edge0 arms: buffers at the end (an "auto" window grows)
        m["staged_window"] = r["staged_window"]
    replay = r.get("eviction_replay", {})
    if c and replay.get("routings_per_token"):  # every tier's loads against every routing: reads avoided
        m["hit_rate"] = 1 - c.get("expert_loads", 0) / replay["routings_per_token"]
    if "hit_rate" in replay:
        m["min_hit_rate"] = replay["hit_rate"]["min"]
        m["lfu_replay_hit_rate"] = replay["hit_rate"]["lfu"]
    if "from_start" in replay:  # the same replay from the cache the timed decode began with
        m["min_hit_rate_from_start"] = replay["from_start"]["hit_rate"]["min"]
        m["lfu_replay_hit_rate_from_start"] = replay["from_start"]["hit_rate"]["lfu"]
    if r.get("locality"):
        m["distinct_experts_per_layer"] = r["locality"]["mean_distinct"]
        m["reuse"] = r["locality"]["mean_reuse"]
    if r.get("decode_s_per_token"):
        m["step_ms"] = r["decode_s_per_token"] * 1e3
        m["step_other_ms"] = m["step_ms"] - m.get("exposed_wait_ms_per_step", 0.0)
        if "exposed_wait_ms_per_step" in m:
            m["wait_share"] = m["exposed_wait_ms_per_step"] / m["step_ms"]
    return m


# Arms every other arm's decode is paired with, round by round: stock mlx-lm, the
# exact path, and the peer a user would run instead (issue 19's "× llama.cpp").
PAIRED_REFERENCES = ("stock", "edge0-exact", "llamacpp")

SUMMARY_METRICS = (
    "load_s", "prefill_tok_s", "ttft_s", "ttft_with_load_s", "warm_prefill_tok_s", "warm_ttft_s",
    "decode_tok_s", "decode_s_per_token", "active_memory_after_load", "peak_memory",
    "decode_peak_memory", "generate_peak_memory", "peak_rss", "wall_s",
)  # fmt: skip


def _stat(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def stats_of(records: list[dict], keys) -> dict:
    """Median, min and max of each key every record has."""
    return {k: _stat([r[k] for r in records]) for k in keys if records and all(k in r for r in records)}


def side_by_side(runs: list[dict]) -> dict[tuple[int, str], dict[str, dict]]:
    """Successful runs by (round, cache slot), then by arm: the runs made side by side."""
    slots: dict[tuple[int, str], dict[str, dict]] = {}
    for r in runs:
        if r["ok"]:
            slots.setdefault((r["round"], r["cache"]), {})[r["arm"]] = r
    return slots


def summarize(runs: list[dict]) -> dict:
    """Per arm and cache state: median and min/max of every metric, the decode
    ratio to each of :data:`PAIRED_REFERENCES` within each round (runs made
    side by side, so slow drifts in machine load cancel), and how often greedy
    tokens equal the reference arm's (stock, else edge0-exact) in the same round."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["arm"], r["cache"]), []).append(r)
    slots = side_by_side(runs)
    arms = {}
    for (arm, cache), rs in groups.items():
        ok = [r for r in rs if r["ok"]]
        entry = {"arm": arm, "cache": cache, "runs": len(rs), "ok": len(ok), **stats_of(ok, SUMMARY_METRICS)}
        counters = [r["counters_per_token"] for r in ok if "counters_per_token" in r]
        if counters:
            entry["counters_per_token"] = stats_of(counters, counters[0])
        metrics = [run_metrics(r) for r in ok]
        entry["metrics"] = stats_of(metrics, metrics[0]) if metrics else {}
        for reference in PAIRED_REFERENCES:
            paired = [s[arm]["decode_tok_s"] / s[reference]["decode_tok_s"]
                      for (_, c), s in slots.items() if c == cache and arm in s and reference in s]  # fmt: skip
            if paired:
                entry[f"decode_vs_{reference.removeprefix('edge0-')}_paired"] = _stat(paired)
        same = []
        for (_, c), s in slots.items():
            reference = s.get("stock") or s.get("edge0-exact")
            if c == cache and arm in s and reference is not None and reference is not s[arm] and not is_peer_arm(arm):
                if "tokens" in s[arm] and "tokens" in reference:  # records made by hand may leave them out
                    same.append(s[arm]["tokens"] == reference["tokens"])
        if same:
            entry["tokens_equal_reference"] = {"same": sum(same), "rounds": len(same)}
        failures = [r for r in rs if not r["ok"]]
        if failures:
            entry["last_error"] = failures[-1]["error"]
        ooms = sum(1 for r in failures if r.get("oom"))
        if ooms:
            entry["oom"] = ooms
        arms[f"{arm}/{cache}"] = entry
    return {"arms": arms}
