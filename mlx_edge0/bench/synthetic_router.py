"""Router weights for synthetic checkpoints whose routing locality is a knob.

A random-weight checkpoint routes however its random routers happen to: the
residual stream of a random model has large components shared by every
token (its mean) or by every token of a sequence, so a random router gives
tokens nearly the same experts (the 12-layer ``qwen3-30b-a3b`` synth reuses
73% of a layer's experts token to token) or, by chance, not. This module rewrites each MoE layer's router
(``mlp.gate``) so that the checkpoint's *own* routing, computed by stock
mlx-lm, has a chosen locality. Nothing changes at run time: edge0, stock
mlx-lm and llama.cpp (whose GGUF converts the same router) route alike.

How: the stock model runs on a batch of short seeded random token
sequences (random ids, as the bench feeds): :data:`CALIBRATION_SEQUENCES`
to set the routers, :data:`HELD_OUT_SEQUENCES` to measure them. Layer by
layer, in forward order, each MoE block's router input ``x`` (the normed
hidden state, after the earlier layers' routers are set) is captured and its
gate is set to::

    w_e = TOKEN_STD * rank_e^(-a) * (sqrt(1 - b) * fast_e + sqrt(b) * slow_e)

- A random model's residual stream carries, besides a mean shared by all
  tokens, a large *per-sequence* part that barely changes from token to
  token (what attention accumulates from the context), and a part that is
  new at every token. A random router reads all of them, which is why its
  locality is an accident. The rows here are orthogonal to the mean and
  split the rest by lag-1 autocorrelation within a sequence (generalized
  eigenvectors of the first-difference covariance against the covariance,
  shrunk): ``fast_e`` are random rows in the fastest quarter of the directions,
  ``slow_e`` in the slowest eighth, each scaled to unit logit std on the
  calibration tokens. ``b`` (stickiness) mixes in the slow part.
- Popularity is the experts' logit *scale*: over a seeded random order of
  the experts, expert of rank r has scale ``r^-a`` (``a = 0``: all equal). A
  wider-spread logit wins a top-K more often. (A per-expert *offset* along
  the mean direction was tried first: the projection on the mean varies too
  much from sequence to sequence, so a strong offset became per-sequence
  stickiness rather than popularity.)

``uniform``: ``a = b = 0``. ``calibrated``: ``a`` is solved by bisection so
that the held-out tokens' pooled 90% coverage is
:data:`~.synthetic_routing.CALIBRATED_COVERAGE90` (0.51), then ``b`` so that
their mean token-to-token reuse is
:data:`~.synthetic_routing.CALIBRATED_REUSE` (0.25) if popularity alone gives
less (both twice). Either may be out of reach: the scale mechanism has a
coverage floor (about 0.62 at E=16, K=4), and what the fast directions leave
of the per-sequence part already gives more than K/E reuse in deeper layers.
What was reached is measured and recorded per layer, never assumed.
bailing_moe's ``expert_bias`` is set to zero (the random one would add
popularity of its own); its sigmoid + group-limited top-k routing is what is
measured.

Routing is measured with each family's own router code (the block's gate and
top-k), on the model in float32 as the bench runs it. The forward multiplies
by dequantized weights (:class:`~.dense_forward.DenseLayers`, the gates
included): the same numbers up to summation order, through BLAS instead of
MLX's CPU quantized kernels, which on thousands of tokens are the slow part.
The gate is stored as
synth stores it (8-bit affine g64 with bf16 scales where mlx-lm's
``quant_predicate`` says so, bf16 otherwise), and the model is updated with
exactly the stored values before the next layer is calibrated.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..progress import bar
from ..tensorfile import array_bytes, read_header
from .dense_forward import DenseLayers
from .locality import RoutingTrace, coverage_per_layer, distinct_per_layer, reuse_per_layer
from .synthetic_routing import BISECTION_STEPS, CALIBRATED_COVERAGE90, CALIBRATED_REUSE

ROUTINGS = ("random", "uniform", "calibrated")
# One batch of seeded random token ids: many short sequences, because each sequence carries its
# own persistent component (see the module docstring) and the knobs must generalize across them.
CALIBRATION_SEQUENCES, HELD_OUT_SEQUENCES = 96, 32
SEQUENCE_TOKENS = 40
SKIP_TOKENS = 8  # the first positions attend to little context: left out of the statistics
TOKEN_STD = 2.0  # per-token logit std (synth's ROUTER_STD): tokens disagree on experts
SHRINK = 0.1  # covariance shrinkage, as a fraction of its mean eigenvalue (N is about D)
FAST_FRACTION = 4  # routers read the fastest 1/4 of the token directions (least per-sequence part)
SLOW_FRACTION = 8  # the slowest 1/8 of the token directions carry the stickiness
MAX_POPULARITY = 4.0  # bisection range for the Zipf exponent of the experts' logit scales
SEED_SALT = 0x524F5554  # "ROUT": calibration token ids differ from the bench's


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's solved knobs and what its held-out sequences measured.

    Attributes:
        popularity: ``a``, the Zipf exponent of the experts' logit scales.
        sticky: ``b``, the share of logit variance read from the slow directions.
        slow_autocorrelation: mean lag-1 autocorrelation of those slow directions.
        coverage90: over all held-out tokens pooled.
        reuse: token-to-token, mean over the held-out sequences.
        distinct: experts touched per held-out sequence, mean over them.
    """

    layer: int
    popularity: float
    sticky: float
    slow_autocorrelation: float
    coverage90: float
    reuse: float
    distinct: float


@dataclass(frozen=True)
class RouterCalibration:
    """What ``config.json`` records under ``edge0_synthetic.router``."""

    routing: str
    sequences: int
    held_out_sequences: int
    tokens: int
    target_coverage90: Optional[float]
    target_reuse: Optional[float]
    layers: list[LayerRouting]
    seconds: float

    def mean(self, name: str) -> float:
        return float(np.mean([getattr(r, name) for r in self.layers]))

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update({f"mean_{n}": self.mean(n) for n in ("popularity", "sticky", "coverage90", "reuse", "distinct")})
        return out


def moe_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(layer index, block)`` of every MoE block, in forward order."""
    return [
        (i, layer.mlp) for i, layer in enumerate(model.layers) if hasattr(getattr(layer, "mlp", None), "switch_mlp")
    ]


def route(block: nn.Module, x: mx.array) -> mx.array:
    """The experts ``block`` routes ``x`` to, by the family's own code."""
    if isinstance(block.gate, (nn.Linear, nn.QuantizedLinear)):  # qwen3_moe, qwen3_next / qwen3_5
        gates = mx.softmax(block.gate(x), axis=-1, precise=True)
        return mx.argpartition(gates, kth=-block.top_k, axis=-1)[..., -block.top_k :]
    return block.gate(x)[0]  # bailing_moe: sigmoid + expert_bias, group-limited top-k


class _Done(Exception):
    """Ends the calibration forward once the last router is set."""


class _Tap(nn.Module):
    """Stands in for an MoE block: calls ``hook(x)`` with its input, then the block."""

    def __init__(self, block: nn.Module, hook: Callable[[mx.array], None]):
        super().__init__()
        self.block = block
        self._hook = hook

    def __call__(self, x: mx.array) -> mx.array:
        self._hook(x)
        return self.block(x)


class _Taps:
    """Context: every MoE block of ``model`` calls ``hook(layer, block, x)`` first.

    :meth:`untap` puts one layer's block back early: a tap nests the block's
    parameters under ``block``, where a reload by the checkpoint's names
    would silently miss them.
    """

    def __init__(self, model: nn.Module, hook: Callable[[int, nn.Module, mx.array], None]):
        self.model, self.hook = model, hook
        self.tapped: dict[int, nn.Module] = {}

    def __enter__(self) -> "_Taps":
        self.tapped = dict(moe_blocks(self.model))
        for i, block in self.tapped.items():
            self.model.layers[i].mlp = _Tap(block, lambda x, i=i, b=block: self.hook(i, b, x))
        return self

    def untap(self, layer: int) -> None:
        block = self.tapped.pop(layer, None)
        if block is not None:
            self.model.layers[layer].mlp = block

    def __exit__(self, *exc) -> None:
        for layer in list(self.tapped):
            self.untap(layer)


@dataclass(frozen=True)
class _LayerStats:
    """A layer's router inputs on the calibration sequences, as the knobs need them.

    ``fast``/``slow``: rows mapping ``x`` to unit-variance, mutually
    uncorrelated token parts whose lag-1 autocorrelation within a sequence
    is lowest / highest (generalized eigenvectors of the first-difference
    covariance against the covariance, both orthogonal to the mean).
    """

    fast: np.ndarray
    slow: np.ndarray
    slow_autocorrelation: float


def _layer_stats(x: np.ndarray) -> _LayerStats:
    """``x``: (sequences, tokens, D) router inputs, first positions already dropped."""
    flat = x.reshape(-1, x.shape[-1])
    mu = flat.mean(axis=0)
    u = mu / np.linalg.norm(mu)
    perp = np.eye(len(u)) - np.outer(u, u)
    z = (flat - mu) @ perp
    diff = (np.diff(x, axis=1).reshape(-1, x.shape[-1]) @ perp) / math.sqrt(2)
    cov, dcov = z.T @ z / len(z), diff.T @ diff / len(diff)
    evals, evecs = np.linalg.eigh(cov + SHRINK * np.trace(cov) / (len(u) - 1) * perp)
    iroot = (evecs[:, 1:] / np.sqrt(evals[1:])) @ evecs[:, 1:].T  # the smallest is the mean direction
    lam, q = np.linalg.eigh(iroot @ dcov @ iroot)  # ascending: slowest first; rho = 1 - lam
    n, n_slow = len(u) - 1, max(1, (len(u) - 1) // SLOW_FRACTION)
    slow = q[:, 1 : 1 + n_slow]  # q[:, 0] is the mean direction (lam = 0)
    fast = q[:, n + 1 - max(1, n // FAST_FRACTION) :]
    return _LayerStats((iroot @ fast).T @ perp, (iroot @ slow).T @ perp, float(1 - lam[1 : 1 + n_slow].mean()))


def _rows(rng: np.random.Generator, basis: np.ndarray, num_experts: int, x: np.ndarray) -> np.ndarray:
    """Random rows in ``basis``'s span whose logits have unit std on ``x`` (tokens, D)."""
    w = rng.standard_normal((num_experts, basis.shape[0])) @ basis
    return w / (x @ w.T).std(axis=0)[:, None]


def _set_gate(block: nn.Module, w: np.ndarray, dtype: mx.Dtype) -> dict[str, mx.array]:
    """Store ``w`` in the gate as synth stores it; returns the stored tensors by parameter name."""
    gate = block.gate
    if isinstance(gate, nn.QuantizedLinear):
        q, scales, biases = mx.quantize(mx.array(w, mx.bfloat16), gate.group_size, gate.bits)
        stored = {"weight": q, "scales": scales, "biases": biases}
    elif isinstance(gate, nn.Linear):
        stored = {"weight": mx.array(w, mx.bfloat16)}
    else:  # bailing_moe's BailingGate: popularity comes from the weights alone
        stored = {"weight": mx.array(w, mx.bfloat16), "expert_bias": mx.zeros(w.shape[0], mx.bfloat16)}
    gate.update({k: v if v.dtype == mx.uint32 else v.astype(dtype) for k, v in stored.items()})
    return stored


def _top_k(block: nn.Module) -> int:
    return block.top_k if hasattr(block, "top_k") else block.gate.top_k


def _bisect(f: Callable[[float], float], hi: float, target: float) -> float:
    """The x in [0, hi] where increasing ``f`` crosses ``target``."""
    lo = 0.0
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _solve_layer(
    block: nn.Module, x: np.ndarray, layer: int, routing: str, rng: np.random.Generator, dtype: mx.Dtype
) -> tuple[LayerRouting, dict[str, mx.array]]:
    """Set ``block``'s gate for ``routing`` from its inputs ``x`` (sequences, tokens, D)."""
    cal, held = x[:CALIBRATION_SEQUENCES, SKIP_TOKENS:], x[CALIBRATION_SEQUENCES:, SKIP_TOKENS:]
    num_experts, k = block.switch_mlp.gate_proj.weight.shape[0], _top_k(block)
    stats = _layer_stats(cal)
    flat = cal.reshape(-1, cal.shape[-1])
    fast, slow = _rows(rng, stats.fast, num_experts, flat), _rows(rng, stats.slow, num_experts, flat)
    c = np.empty(num_experts)
    c[rng.permutation(num_experts)] = -np.log(np.arange(1, num_experts + 1))
    held_mx = mx.array(held.reshape(-1, held.shape[-1])).astype(dtype)

    def measure(popularity: float, sticky: float) -> tuple[list[RoutingTrace], dict]:
        scale = np.exp(popularity * c)[:, None]
        w = TOKEN_STD * scale * (math.sqrt(1 - sticky) * fast + math.sqrt(sticky) * slow)
        stored = _set_gate(block, w, dtype)
        sets = np.sort(np.array(route(block, held_mx)), axis=-1).reshape(len(held), -1, k)
        traces = [RoutingTrace((layer,), num_experts, k, tuple((tuple(t),) for t in seq.tolist())) for seq in sets]
        return traces, stored

    def coverage(traces: list[RoutingTrace]) -> float:
        pooled = RoutingTrace((layer,), num_experts, k, tuple(t for tr in traces for t in tr.tokens))
        return coverage_per_layer(pooled)[0]

    def reuse(traces: list[RoutingTrace]) -> float:
        return float(np.mean([reuse_per_layer(t)[0] for t in traces]))

    popularity = sticky = 0.0
    if routing == "calibrated":
        for _ in range(2):  # stickiness shifts the coverage a little: solve twice
            popularity = _bisect(lambda a: -coverage(measure(a, sticky)[0]), MAX_POPULARITY, -CALIBRATED_COVERAGE90)
            sticky = 0.0
            if reuse(measure(popularity, 0.0)[0]) < CALIBRATED_REUSE:
                sticky = _bisect(lambda b: reuse(measure(popularity, b)[0]), 1.0, CALIBRATED_REUSE)
    traces, stored = measure(popularity, sticky)
    result = LayerRouting(
        layer=layer,
        popularity=popularity,
        sticky=sticky,
        slow_autocorrelation=stats.slow_autocorrelation,
        coverage90=coverage(traces),
        reuse=reuse(traces),
        distinct=float(np.mean([distinct_per_layer(t)[0] for t in traces])),
    )
    return result, stored


def calibrate_routers(
    model: nn.Module,
    routing: str,
    *,
    vocab_size: int,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    show_progress: bool = True,
    release: Optional[Callable[[int], None]] = None,
) -> tuple[RouterCalibration, dict[str, mx.array]]:
    """Set every MoE router of ``model`` (a stock mlx-lm model whose floats are
    ``dtype``, as the bench runs it) for ``routing`` (``uniform`` or ``calibrated``).

    ``release(i)`` is called for each decoder layer ``i`` once the forward is
    past it (its output evaluated and its quantized modules back in place). A
    caller whose weights load lazily can put that layer's lazy loads back, so
    one layer at a time is resident: a full-depth 35B does not fit in memory
    at once.

    Returns:
        The solved knobs and held-out measurements, and the new router tensors
        by parameter name, in the dtypes the checkpoint stores.
    """
    if routing not in ROUTINGS[1:]:
        raise ValueError(f"routing {routing!r} has no calibration; choose one of {', '.join(ROUTINGS[1:])}")
    start = time.perf_counter()
    rng = np.random.default_rng([seed, SEED_SALT])
    shape = (CALIBRATION_SEQUENCES + HELD_OUT_SEQUENCES, SEQUENCE_TOKENS)
    ids = mx.array(rng.integers(0, vocab_size, shape), mx.int32)
    names = {id(block): name for name, block in model.named_modules()}
    results: list[LayerRouting] = []
    stored: dict[str, mx.array] = {}
    blocks = moe_blocks(model)
    with bar(len(blocks), f"[synth] {routing} routers", unit="layer", show=show_progress) as progress:
        done = [0]  # decoder layers before this one are evaluated once x is

        def hook(layer: int, block: nn.Module, x: mx.array) -> None:
            inputs = np.array(x.astype(mx.float32))
            for i in range(done[0], layer) if release else ():
                dense.restore(i)  # by the names it took them under, the tap's
                taps.untap(i)
                release(i)
            done[0] = layer
            result, tensors = _solve_layer(block, inputs, layer, routing, rng, dtype)
            results.append(result)
            prefix = f"{names[id(block)]}.gate"
            stored.update({f"{prefix}.{k}": v for k, v in tensors.items()})
            progress.update()
            if layer == blocks[-1][0]:
                raise _Done  # nothing after the last router is needed (the LM head is the costliest part)

        with _Taps(model, hook) as taps, DenseLayers(model) as dense:
            try:
                mx.eval(model(ids))
            except _Done:
                pass
    calibration = RouterCalibration(
        routing=routing,
        sequences=CALIBRATION_SEQUENCES,
        held_out_sequences=HELD_OUT_SEQUENCES,
        tokens=SEQUENCE_TOKENS - SKIP_TOKENS,
        target_coverage90=CALIBRATED_COVERAGE90 if routing == "calibrated" else None,
        target_reuse=CALIBRATED_REUSE if routing == "calibrated" else None,
        layers=results,
        seconds=time.perf_counter() - start,
    )
    return calibration, stored


def patch_tensors(root: Path, tensors: dict[str, mx.array], weight_map: dict[str, str]) -> None:
    """Overwrite tensors in place in ``root``'s shards (same dtype and shape only)."""
    for name, value in tensors.items():
        path = root / weight_map[name]
        entry = read_header(path).entries[name]
        data = array_bytes(value)
        if data.nbytes != entry.nbytes or tuple(value.shape) != entry.shape:
            raise ValueError(
                f"{path}: {name} is {entry.shape} {entry.dtype}, the new router {value.shape} {value.dtype}"
            )
        with open(path, "r+b") as f:
            f.seek(entry.start)
            f.write(data)


def teacher_forced_trace(
    model: nn.Module, *, vocab_size: int, prompt_tokens: int, decode_tokens: int, seed: int
) -> RoutingTrace:
    """The decoded tokens' routing as the bench records it (``measure.py``): a
    seeded random prompt prefilled, warm-up steps, then ``decode_tokens``
    steps teacher-forced with :func:`~.run_spec.forced_tokens`."""
    from mlx_lm.models.cache import make_prompt_cache

    from .run_spec import WARMUP_STEPS, forced_tokens

    blocks = moe_blocks(model)
    num_experts, k = blocks[0][1].switch_mlp.gate_proj.weight.shape[0], _top_k(blocks[0][1])
    calls: list[tuple[int, list[int]]] = []
    recording = [False]

    def hook(layer: int, block: nn.Module, x: mx.array) -> None:
        if recording[0]:
            calls.append((layer, np.array(route(block, x)).reshape(-1).tolist()))

    prompt = np.random.default_rng(seed).integers(0, vocab_size, prompt_tokens)
    fed = forced_tokens(vocab_size, WARMUP_STEPS + decode_tokens, seed)
    cache = make_prompt_cache(model)
    with _Taps(model, hook):
        mx.eval(model(mx.array(prompt, mx.int32)[None], cache=cache))
        for step, token in enumerate(fed):
            recording[0] = step >= WARMUP_STEPS
            mx.eval(model(mx.array([[token]], mx.int32), cache=cache))
    return RoutingTrace.from_calls(calls, num_experts, k, f"teacher-forced, seed {seed}")
