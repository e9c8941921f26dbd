"""The bench's arms: their names, and what each loads with.

An arm is ``ARM[+PAGE_CACHE][@GiB]``: ``stock`` (mlx-lm, resident), an edge0
path (``edge0-exact``, ``edge0-hot``, ``edge0-staged``, the prerouter and its
windows) with an optional page-cache policy and hot-cache budget, or a
llama.cpp peer (``llamacpp``, ``llamacpp-direct``) run on ``STOCK.gguf``.
No MLX here: the parent process parses arms before any child loads one.
"""

from __future__ import annotations

from pathlib import Path

ARMS = ("stock", "edge0-exact", "edge0-hot", "edge0-staged", "edge0-prerouter")  # the suite's default
STAGED_WINDOW = 4  # the window arm's buffers: reads about two prerouted layers ahead
# llama.cpp on the same model as a GGUF (bench/gguf_peer.py, bench/llamacpp.py), by load mode.
PEER_ARMS = {"llamacpp": "mmap", "llamacpp-direct": "direct-io"}
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
    """``edge0-hot+bypass@0.5`` -> ("edge0-hot", "bypass", "0.5"): ``ARM[+PAGE_CACHE][@GiB]``,
    absent parts empty (not validated: see :func:`parse_arm`)."""
    name, _, budget = arm.partition("@")
    base, _, page_cache = name.partition("+")
    return base, page_cache, budget


def arm_base(arm: str) -> str:
    """``edge0-hot+bypass@0.5`` -> ``edge0-hot``."""
    return split_arm(arm)[0]


def parse_arm(arm: str) -> tuple[str, dict]:
    """``edge0-hot+bypass@0.5`` -> ("edge0-hot", load options with page_cache="bypass",
    cache_gib=0.5): ``ARM[+PAGE_CACHE][@GiB]``."""
    from ..options import PAGE_CACHE_POLICIES  # mlx is imported by the child only

    base, page_cache, budget = split_arm(arm)
    if (
        base not in KNOWN_ARMS
        or (budget and base not in BUDGET_ARMS)
        or (page_cache and (base == "stock" or base in PEER_ARMS or page_cache not in PAGE_CACHE_POLICIES))
    ):
        raise ValueError(
            f"unknown arm {arm!r}: use {', '.join(KNOWN_ARMS)} (edge0 arms may add "
            f"+{'|'.join(PAGE_CACHE_POLICIES)}, then {', '.join(BUDGET_ARMS)} may add @GiB)"
        )
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
