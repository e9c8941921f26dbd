"""The bench's arms: their names, and what each loads with.

An arm is ``ARM[+PAGE_CACHE][@GiB][/kK]``: ``stock`` (mlx-lm, resident), an
edge0 path (``edge0-exact``, ``edge0-hot``, ``edge0-staged``, the prerouter and
its windows) with an optional page-cache policy, hot-cache budget and K tier,
or a llama.cpp peer (``llamacpp``, ``llamacpp-direct``) run on ``STOCK.gguf``.
A K tier arm (``edge0-prerouter+bypass/k4``) runs the prerouted layers at K on
``EDGE0-kK``, a copy of the checkpoint whose heads are for that K
(:func:`tier_checkpoint`), so both tiers can alternate in one run.
No MLX here: the parent process parses arms before any child loads one.
"""

from __future__ import annotations

from pathlib import Path

ARMS = ("stock", "edge0-exact", "edge0-hot", "edge0-staged", "edge0-prerouter")  # the suite's default
STAGED_WINDOW = 4  # the window arm's buffers: reads about two prerouted layers ahead
# llama.cpp on the same model as a GGUF (bench/gguf_peer.py, bench/llamacpp.py), by load mode.
PEER_ARMS = {"llamacpp": "mmap", "llamacpp-direct": "direct-io"}
TIER_MARK = "/k"  # ARM/k4: the K tier, last in an arm's name
WINDOW_ARMS = ("edge0-prerouter-window", "edge0-prerouter-window-auto")
KNOWN_ARMS = ARMS + WINDOW_ARMS + tuple(PEER_ARMS)
BUDGET_ARMS = ("edge0-hot", "edge0-staged", "edge0-prerouter", *WINDOW_ARMS)
# Load options per edge0 arm. Staged uses the routing of the current step; the window
# arms are the prerouter with STAGED_WINDOW shared staged buffers or an "auto" window (a
# run records its final depth); hot, staged and the prerouter arms take a budget: ARM@GiB.
ARM_OPTIONS = {
    "edge0-exact": dict(cache_gib=0, staged=False, prefill="exact", prerouter=False),
    "edge0-hot": dict(staged=False, prefill="auto", prerouter=False),
    "edge0-staged": dict(staged=True, prefill="auto", prerouter=False),
    "edge0-prerouter": dict(staged=False, prefill="auto", prerouter=True),
    "edge0-prerouter-window": dict(staged=False, prefill="auto", prerouter=True, staged_window=STAGED_WINDOW),
    "edge0-prerouter-window-auto": dict(staged=False, prefill="auto", prerouter=True, staged_window="auto"),
}


def split_arm(arm: str) -> tuple[str, str, str]:
    """``edge0-hot+bypass@0.5/k4`` -> ("edge0-hot", "bypass", "0.5"): ``ARM[+PAGE_CACHE][@GiB]``,
    absent parts empty, the K tier left out (:func:`arm_tier`; not validated: see
    :func:`parse_arm`)."""
    name, _, budget = arm.partition(TIER_MARK)[0].partition("@")
    base, _, page_cache = name.partition("+")
    return base, page_cache, budget


def arm_tier(arm: str) -> int:
    """``edge0-prerouter/k4`` -> 4; 0 for an arm without a K tier (the checkpoint's own K).
    Raises ValueError when the tier is not a positive integer."""
    _, mark, tier = arm.partition(TIER_MARK)
    if not mark:
        return 0
    if not tier.isdigit() or int(tier) < 1:
        raise ValueError(
            f"arm {arm!r}: K tier {tier!r} is not a positive integer (e.g. {arm.partition(TIER_MARK)[0]}/k4)"
        )
    return int(tier)


def with_budget(arm: str, gib: float) -> str:
    """``edge0-hot/k4`` at 0.5 GiB -> ``edge0-hot@0.5/k4``."""
    name, mark, tier = arm.partition(TIER_MARK)
    return f"{name}@{gib:g}{mark}{tier}"


def tier_checkpoint(edge0: Path, k: int) -> Path:
    """Where a K tier arm's checkpoint is: ``EDGE0-kK``, beside EDGE0 (a copy
    whose heads are for K; ``cp -al`` shares the expert files, and
    ``edge0 heads init`` replaces the heads and config.json atomically, so the
    original keeps its own)."""
    edge0 = Path(edge0)
    return edge0.parent / f"{edge0.name}-k{k}"


def arm_base(arm: str) -> str:
    """``edge0-hot+bypass@0.5`` -> ``edge0-hot``."""
    return split_arm(arm)[0]


def parse_arm(arm: str) -> tuple[str, dict]:
    """``edge0-hot+bypass@0.5`` -> ("edge0-hot", load options with page_cache="bypass",
    cache_gib=0.5): ``ARM[+PAGE_CACHE][@GiB][/kK]`` (the tier: :func:`arm_tier`)."""
    from ..options import PAGE_CACHE_POLICIES  # mlx is imported by the child only

    base, page_cache, budget = split_arm(arm)
    edge0 = base in KNOWN_ARMS and base != "stock" and base not in PEER_ARMS
    if (
        base not in KNOWN_ARMS
        or (budget and base not in BUDGET_ARMS)
        or (page_cache and (not edge0 or page_cache not in PAGE_CACHE_POLICIES))
        or (TIER_MARK in arm and not edge0)
    ):
        raise ValueError(
            f"unknown arm {arm!r}: use {', '.join(KNOWN_ARMS)} (edge0 arms may add "
            f"+{'|'.join(PAGE_CACHE_POLICIES)}, then {', '.join(BUDGET_ARMS)} may add @GiB, "
            f"then edge0 arms may add a K tier {TIER_MARK}K)"
        )
    arm_tier(arm)
    options = dict(ARM_OPTIONS.get(base, {}))
    if page_cache:
        options["page_cache"] = page_cache
    if budget:
        try:
            options["cache_gib"] = float(budget)
        except ValueError:
            raise ValueError(f"arm {arm!r}: budget {budget!r} is not a number of GiB") from None
    return base, options


def is_peer_arm(arm: str) -> bool:
    return arm_base(arm) in PEER_ARMS


def peer_gguf_path(stock: Path) -> Path:
    """Where ``edge0 bench gguf STOCK`` writes the peer's GGUF: ``STOCK.gguf``, beside STOCK."""
    stock = Path(stock)
    return stock.parent / f"{stock.name}.gguf"
