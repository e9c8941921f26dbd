"""Routing traces and the locality they have: what any expert cache can exploit.

A :class:`RoutingTrace` is what decode routed, token by token: for every
token, for every MoE layer, the set of routed expert ids. The functions here
are pure measurements of one trace (no model, no files but the trace's JSON):

- :func:`distinct_per_layer`: how many experts of each layer the trace touches
  at all (the working set a per-layer cache would need).
- :func:`reuse_per_layer`: token-to-token reuse, the mean over tokens of
  ``|S_t ∩ S_{t-1}| / |S_t|`` per layer (``|S_t|`` is K at batch 1). Uniform
  independent routing gives K/E on average (:func:`uniform_reuse`).
- :func:`top_share_per_layer`: expert popularity skew, the share of a layer's
  routings taken by its most used tenth of experts (:func:`top_count`
  experts). Chosen over a Gini coefficient because it reads directly as a
  cache quantity: it is the hit rate of a static per-layer cache that holds
  the hottest tenth of the experts, knowing the counts in advance (what
  frequency caching can reach at that size). Uniform routing gives
  ``top_count / E`` (:func:`uniform_top_share`); on a short trace sampling
  noise alone lifts it above that.
- :func:`coverage_per_layer`: the fraction of a layer's experts that, taken
  hottest first, cover a given share of its routings (90% by default): the
  form in which a published Qwen3-30B-A3B measurement is reported (see
  BENCHMARKS.md, "Routing locality").
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

TRACE_FORMAT = "edge0-routing-trace"
TRACE_VERSION = 1


@dataclass(frozen=True)
class RoutingTrace:
    """Routed expert ids per token and MoE layer.

    Attributes:
        layers: the MoE layer indices (in ``model.layers``), in forward order.
        num_experts: experts per layer (E).
        k: routed experts per token (K) of an unbatched decode step.
        tokens: ``tokens[t][i]`` is the sorted tuple of experts token ``t``
            routed to in ``layers[i]``.
        source: free text saying where the trace came from.
    """

    layers: tuple[int, ...]
    num_experts: int
    k: int
    tokens: tuple[tuple[tuple[int, ...], ...], ...]
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(
            self, "tokens", tuple(tuple(tuple(sorted(int(e) for e in s)) for s in tok) for tok in self.tokens)
        )
        if self.num_experts < 1 or self.k < 1:
            raise ValueError(f"num_experts and k must be positive, got {self.num_experts} and {self.k}")
        for t, tok in enumerate(self.tokens):
            if len(tok) != len(self.layers):
                raise ValueError(f"token {t} has {len(tok)} routed sets for {len(self.layers)} MoE layers")
            for ids in tok:
                if any(not 0 <= e < self.num_experts for e in ids) or len(set(ids)) != len(ids):
                    raise ValueError(f"token {t}: routed set {ids} is not distinct ids in [0, {self.num_experts})")

    @classmethod
    def from_calls(
        cls, calls: Iterable[tuple[int, Sequence[int]]], num_experts: int, k: int, source: str = ""
    ) -> "RoutingTrace":
        """Group a runtime recording (``(layer, ids)`` per MoE call, as
        ``runtime.telemetry.routing_trace`` holds it) into tokens: a token ends when the
        layer index stops increasing.

        Raises:
            ValueError: a token does not visit the same layers as the first.
        """
        tokens: list[list[tuple[int, Sequence[int]]]] = []
        for layer, ids in calls:
            if not tokens or layer <= tokens[-1][-1][0]:
                tokens.append([])
            tokens[-1].append((int(layer), ids))
        layers = tuple(layer for layer, _ in tokens[0]) if tokens else ()
        for t, tok in enumerate(tokens):
            if tuple(layer for layer, _ in tok) != layers:
                raise ValueError(
                    f"token {t} visits MoE layers {[x for x, _ in tok]}, token 0 visited {list(layers)}: "
                    "record decode steps of one sequence only"
                )
        return cls(layers, num_experts, k, tuple(tuple(ids for _, ids in tok) for tok in tokens), source)

    def as_dict(self) -> dict:
        """The fields as JSON types (``RoutingTrace(**d)`` rebuilds it)."""
        return asdict(self)

    def save(self, path: Path | str) -> None:
        data = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **self.as_dict()}
        Path(path).write_text(json.dumps(data, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: Path | str) -> "RoutingTrace":
        data = json.loads(Path(path).read_text())
        if data.pop("format", None) != TRACE_FORMAT or data.pop("version", None) != TRACE_VERSION:
            raise ValueError(f"{path} is not an {TRACE_FORMAT} v{TRACE_VERSION} file")
        return cls(**data)

    def layer_sets(self, i: int) -> list[tuple[int, ...]]:
        """The routed sets of ``layers[i]``, one per token."""
        return [tok[i] for tok in self.tokens]

    def routed_k(self) -> tuple[int, ...]:
        """Each MoE layer's K as the trace routed it (a K-tier decode routes its
        first MoE layer, which no head predicts, at the checkpoint's K)."""
        return tuple(max(map(len, self.layer_sets(i))) for i in range(len(self.layers)))

    def calls(self) -> list[tuple[int, tuple[int, ...]]]:
        """``(layer, ids)`` per MoE call in forward order (the runtime's form)."""
        return [(layer, ids) for tok in self.tokens for layer, ids in zip(self.layers, tok)]

    @property
    def routings(self) -> int:
        """Routed (layer, expert) pairs over the whole trace."""
        return sum(len(ids) for tok in self.tokens for ids in tok)


def distinct_per_layer(trace: RoutingTrace) -> list[int]:
    """Experts each MoE layer routes to at least once."""
    return [len(set().union(*trace.layer_sets(i))) for i in range(len(trace.layers))]


def reuse_per_layer(trace: RoutingTrace) -> list[float]:
    """Mean of ``|S_t ∩ S_{t-1}| / |S_t|`` over tokens 1..T-1, per layer (nan with one token)."""
    out = []
    for i in range(len(trace.layers)):
        sets = trace.layer_sets(i)
        pairs = [len(set(a) & set(b)) / len(b) for a, b in zip(sets, sets[1:]) if b]
        out.append(sum(pairs) / len(pairs) if pairs else math.nan)
    return out


def uniform_reuse(trace: RoutingTrace) -> float:
    """Expected reuse of uniform independent routing: K/E."""
    return trace.k / trace.num_experts


def counts_per_layer(trace: RoutingTrace) -> list[list[int]]:
    """How often each expert of each layer was routed to: ``[layer][expert]``."""
    counts = [[0] * trace.num_experts for _ in trace.layers]
    for tok in trace.tokens:
        for i, ids in enumerate(tok):
            for e in ids:
                counts[i][e] += 1
    return counts


def top_count(num_experts: int, fraction: float = 0.1) -> int:
    """The number of experts in a layer's top ``fraction`` (at least one)."""
    return max(1, math.ceil(num_experts * fraction - 1e-9))


def top_share_per_layer(trace: RoutingTrace, fraction: float = 0.1) -> list[float]:
    """Share of each layer's routings taken by its ``top_count`` most used experts."""
    n = top_count(trace.num_experts, fraction)
    out = []
    for counts in counts_per_layer(trace):
        total = sum(counts)
        out.append(sum(sorted(counts, reverse=True)[:n]) / total if total else math.nan)
    return out


def uniform_top_share(trace: RoutingTrace, fraction: float = 0.1) -> float:
    """Top share of a perfectly uniform popularity: ``top_count / E``."""
    return top_count(trace.num_experts, fraction) / trace.num_experts


def coverage_per_layer(trace: RoutingTrace, share: float = 0.9) -> list[float]:
    """Fraction of each layer's E experts that, hottest first, take ``share`` of its routings."""
    out = []
    for counts in counts_per_layer(trace):
        total, covered = sum(counts), 0
        for n, c in enumerate(sorted(counts, reverse=True), 1):
            covered += c
            if covered >= share * total - 1e-9:
                out.append(n / trace.num_experts)
                break
        else:
            out.append(math.nan)
    return out


@dataclass(frozen=True)
class LocalitySummary:
    """The locality numbers every routing result reports (means over layers
    with their per-layer values)."""

    tokens: int
    distinct: list[int]
    reuse: list[float]
    top_share: list[float]
    coverage90: list[float]
    uniform_reuse: float
    uniform_top_share: float

    @classmethod
    def of(cls, trace: RoutingTrace) -> "LocalitySummary":
        return cls(
            tokens=len(trace.tokens),
            distinct=distinct_per_layer(trace),
            reuse=reuse_per_layer(trace),
            top_share=top_share_per_layer(trace),
            coverage90=coverage_per_layer(trace),
            uniform_reuse=uniform_reuse(trace),
            uniform_top_share=uniform_top_share(trace),
        )

    def mean(self, name: str) -> float:
        values = [v for v in getattr(self, name) if not math.isnan(v)]
        return sum(values) / len(values) if values else math.nan

    def as_dict(self) -> dict:
        return asdict(self) | {f"mean_{n}": self.mean(n) for n in ("distinct", "reuse", "top_share", "coverage90")}
