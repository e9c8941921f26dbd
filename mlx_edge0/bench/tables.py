"""Tables of benchmark results: one builder per table, rendered as Markdown or HTML.

A table is headers plus rows of already formatted cells, built once from a
results summary (``summary.summarize``) so the Markdown summary and the HTML
report cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .arms import STAGED_WINDOW, arm_tier, split_arm

GIB, MB = 2**30, 1e6
ARM_LABELS = {
    "edge0-staged": "edge0-staged (current-step routing)",
    "edge0-prerouter-window": f"edge0-prerouter, staged window of {STAGED_WINDOW}",
    "edge0-prerouter-window-auto": "edge0-prerouter, staged window auto",
}


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list[str]]
    caption: str = ""
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in self.rows]
        if self.caption:
            lines += ["", self.caption]
        return "\n".join(lines + [f"\n{n}" for n in self.notes])


def _md_cell(text: str) -> str:
    """A cell that cannot break the table or read as HTML (profile rows hold ``<built-in ...>``)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def arm_label(arm: str) -> str:
    base, page_cache, budget = split_arm(arm)
    tier = arm_tier(arm)
    return (
        ARM_LABELS.get(base, base)
        + (f", page cache {page_cache}" if page_cache else "")
        + (f" @ {budget} GiB" if budget else "")
        + (f", K={tier}" if tier else "")
    )


def stat(entry: Optional[dict], key: str, group: Optional[str] = None) -> Optional[dict]:
    """A metric's {median, min, max} from a summary entry (or a sub-group of it)."""
    if entry is None:
        return None
    source = entry.get(group, {}) if group else entry
    return source.get(key)


def median(entry: Optional[dict], key: str, group: Optional[str] = None) -> Optional[float]:
    s = stat(entry, key, group)
    return None if s is None else s["median"]


def cell(s: Optional[dict], scale: float = 1.0, digits: int = 2, spread: bool = True) -> str:
    """``median (min–max)``, scaled; ``-`` when missing."""
    if s is None:
        return "-"
    med, lo, hi = (s[k] / scale for k in ("median", "min", "max"))
    if not spread or lo == hi:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def ratio(a: Optional[float], b: Optional[float], digits: int = 2) -> str:
    return "-" if a is None or not b else f"{a / b:.{digits}f}"


def change(new: Optional[float], old: Optional[float]) -> str:
    """Relative change in percent, signed."""
    return "-" if new is None or not old else f"{(new / old - 1) * 100:+.0f}%"


def _io_cells(e: dict) -> list[str]:
    return [
        cell(stat(e, "exposed_wait_ms_per_step", "metrics"), digits=1),
        cell(stat(e, "loads_per_token", "metrics"), digits=1, spread=False),
        cell(stat(e, "mib_per_load", "metrics"), digits=2, spread=False),
        cell(stat(e, "bytes_per_token", "metrics"), MB, 1, spread=False),
        cell(stat(e, "hot_hit_rate", "metrics"), spread=False),
        cell(stat(e, "staged_hit_rate", "metrics"), spread=False),
        cell(stat(e, "hit_rate", "metrics"), spread=False),
        cell(stat(e, "lfu_replay_hit_rate", "metrics"), spread=False),
        cell(stat(e, "min_hit_rate", "metrics"), spread=False),
        cell(stat(e, "lfu_replay_hit_rate_from_start", "metrics"), spread=False),
        cell(stat(e, "min_hit_rate_from_start", "metrics"), spread=False),
        cell(stat(e, "device_bytes_per_token", "metrics"), MB, 1, spread=False),
        cell(stat(e, "distinct_experts_per_layer", "metrics"), digits=1, spread=False),
        cell(stat(e, "reuse", "metrics"), spread=False),
    ]


IO_HEADERS = ["exposed wait ms/step", "loads/token", "MiB/load", "MB/token", "hot hit rate",
              "staged slots filled from memory", "routings served from memory",
              "replay from empty: LFU", "replay from empty: Belady's MIN",
              "replay from the decode's start: LFU", "replay from the decode's start: Belady's MIN",
              "device MB/token", "experts/layer touched",
              "token-to-token reuse"]  # fmt: skip


def speed_table(summary: dict, reference: Optional[dict] = None) -> Table:
    """Throughput and latency per arm and cache state; ×stock against the same
    cache state's stock arm (of ``reference`` when this summary has none),
    columns left out where no arm has a stock arm to compare with (a run of
    edge0 arms and the peer only)."""
    arms = summary.get("arms", {})
    reference_arms = (reference or {}).get("arms", {})
    stocks = [arms.get(f"stock/{e['cache']}") or reference_arms.get(f"stock/{e['cache']}") for e in arms.values()]
    with_stock = any(stocks)
    rows = []
    for e, stock in zip(arms.values(), stocks):
        tok_s = median(e, "decode_tok_s")
        versus_stock = [ratio(tok_s, median(stock, "decode_tok_s")), cell(stat(e, "decode_vs_stock_paired"))]
        rows.append([
            arm_label(e["arm"]), e["cache"], f"{e['ok']}/{e['runs']}",
            cell(stat(e, "decode_tok_s"), digits=rate_digits(tok_s)),
            *(versus_stock if with_stock else []),
            cell(stat(e, "prefill_tok_s")), cell(stat(e, "warm_prefill_tok_s")),
            cell(stat(e, "ttft_s")), cell(stat(e, "ttft_with_load_s")), cell(stat(e, "load_s")),
        ])  # fmt: skip
    headers = ["arm", "cache", "ok/runs", "decode tok/s",
               *(["× stock (medians)", "× stock (per round)"] if with_stock else []),
               "prefill tok/s (cold request)",
               "prefill tok/s (warm request)", "TTFT s", "TTFT s incl. load", "load s"]  # fmt: skip
    return Table(headers, rows, notes=_failures(summary))


def memory_table(summary: dict) -> Table:
    """Memory and expert I/O per arm and cache state."""
    rows = []
    for e in summary.get("arms", {}).values():
        rows.append([
            arm_label(e["arm"]), e["cache"],
            cell(stat(e, "peak_memory"), GIB, spread=False), cell(stat(e, "decode_peak_memory"), GIB, spread=False),
            cell(stat(e, "peak_rss"), GIB, spread=False), *_io_cells(e),
        ])  # fmt: skip
    headers = ["arm", "cache", "peak MLX GiB", "decode peak MLX GiB", "peak RSS GiB", *IO_HEADERS]
    return Table(headers, rows)


def pressure_table(summary: dict) -> Table:
    """Arms under memory pressure, decode against the exact (on-demand, no cache)
    arm of the same round."""
    rows = []
    for e in summary.get("arms", {}).values():
        rows.append([
            arm_label(e["arm"]), f"{e['ok']}/{e['runs']}", cell(stat(e, "decode_tok_s"), digits=3),
            cell(stat(e, "decode_vs_exact_paired")),
            cell(stat(e, "peak_memory"), GIB, spread=False), cell(stat(e, "decode_peak_memory"), GIB, spread=False),
            *_io_cells(e),
        ])  # fmt: skip
    headers = [
        "arm",
        "ok/runs",
        "decode tok/s",
        "× exact (per round)",
        "peak MLX GiB",
        "decode peak MLX GiB",
        *IO_HEADERS,
    ]
    return Table(headers, rows, notes=_failures(summary))


def rate_digits(value: Optional[float]) -> int:
    """Decimals that keep three significant digits of a rate under 0.1 (a
    peer's 0.00657 tok/s), three above."""
    return 3 if not value or value >= 0.1 else 2 - math.floor(math.log10(value))


def read_bound_cells(tok_s: Optional[float], device_bytes: Optional[float], read_mbps: Optional[float]) -> list[str]:
    """The tok/s the read throttle allows at ``device_bytes`` a token
    (``read_mbps`` ÷ MB a token) and the share of it ``tok_s`` reaches; ``-``
    where reads were not throttled or the bytes are unknown."""
    bound = read_mbps * MB / device_bytes if read_mbps and device_bytes else None
    return ["-" if bound is None else f"{bound:.{rate_digits(bound)}f}", ratio(tok_s, bound)]


def regime_table(summary: dict, read_mbps: Optional[float] = None) -> Table:
    """Each arm against the disk and the peer (issue 19): the tok/s the read
    throttle allows at the arm's device bytes per token (``read_mbps`` ÷ MB a
    token), the share of it the decode reaches (the disk idles for the rest),
    where a step's time went, and the decode ratio to llama.cpp's mmap arm
    within each round."""
    rows = []
    for e in summary.get("arms", {}).values():
        tok_s, device = median(e, "decode_tok_s"), median(e, "device_bytes_per_token", "metrics")
        waited = stat(e, "wait_share", "metrics") is not None  # peers record no wait
        rows.append([
            arm_label(e["arm"]), e["cache"], cell(stat(e, "decode_tok_s"), digits=rate_digits(tok_s)),
            cell(stat(e, "decode_vs_llamacpp_paired")),
            cell(stat(e, "device_bytes_per_token", "metrics"), MB, 1, spread=False),
            *read_bound_cells(tok_s, device, read_mbps),
            cell(stat(e, "step_ms", "metrics"), digits=0, spread=False),
            cell(stat(e, "wait_share", "metrics"), 0.01, 1, spread=False),
            cell(stat(e, "step_other_ms", "metrics"), digits=0, spread=False) if waited else "-",
        ])  # fmt: skip
    rate = f"{read_mbps:g}" if read_mbps else "read MB/s"
    headers = ["arm", "cache", "decode tok/s", "× llama.cpp (per round)", "device MB/token",
               f"read bound tok/s ({rate} ÷ MB)", "of the bound", "step ms",
               "exposed wait, % of the step", "step less wait ms"]  # fmt: skip
    caption = "Step: wall time per decoded token; its wait share and the step less wait: medians of each run's."
    return Table(headers, rows, caption=caption)


def _failures(summary: dict) -> list[str]:
    return [f"{e['arm']}/{e['cache']} failed: {e['last_error']} (stderr tail in the JSON)"
            for e in summary.get("arms", {}).values() if "last_error" in e]  # fmt: skip


def agreement_note(summary: dict) -> str:
    """Which arms predicted the reference arm's tokens (stock, else exact): the
    argmax at every position of the same teacher-forced sequence."""
    same, differ = [], []
    for e in summary.get("arms", {}).values():
        t = e.get("tokens_equal_reference")
        if t:
            label = f"{arm_label(e['arm'])}/{e['cache']}"
            (same if t["same"] == t["rounds"] else differ).append(
                label if t["same"] in (0, t["rounds"]) else f"{label} ({t['same']} of {t['rounds']} rounds)"
            )
    if not same and not differ:
        return ""
    # the reference is stock where it ran (a run the OOM killer ended is no reference)
    stock_ran = any(e["arm"] == "stock" and e["ok"] for e in summary["arms"].values())
    reference = "stock's" if stock_ran else "edge0-exact's"
    parts = []
    if same:
        parts.append(
            f"Next-token picks (argmax on the same fed tokens) equal {reference} in every round: {', '.join(same)}."
        )
    if differ:
        parts.append(
            f"Differ from {reference}: {', '.join(differ)} (prerouted arms with warm-started "
            "heads route differently by design; at a lower K every arm computes another model)."
        )
    return " ".join(parts)


def markdown_table(summary: dict, read_mbps: Optional[float] = None) -> str:
    """Every metric per arm and cache state (the ``edge0 bench run`` printout);
    where reads were throttled (``read_mbps``) or llama.cpp ran, each arm
    against the read bound and the peer too."""
    parts = [speed_table(summary).markdown(), memory_table(summary).markdown()]
    peer = any("decode_vs_llamacpp_paired" in e for e in summary.get("arms", {}).values())
    if read_mbps or peer:
        parts.append(regime_table(summary, read_mbps).markdown())
    note = agreement_note(summary)
    return "\n\n".join(parts + ([note] if note else []))
