"""``edge0 bench synth --routing``: the checkpoint's own routers have the chosen
locality, as the bench records it (stock mlx-lm, float32, teacher-forced
decode after a 32-token random prompt: ``measure.py``'s sequence).

Small configs of tests/test_bench.py with E=64, K=4 (K/E = 1/16: room between
uniform and the targets; at E=16 the router's popularity mechanism cannot go
below about 0.62 coverage). Tolerances:

- uniform: reuse within 0.08 of K/E per layer, on the held-out sequences the
  calibration records and on the bench's 64 decoded tokens (measured 0.07-0.13;
  what the fast directions leave of each sequence's persistent part), and
  at least 85% of the distinct experts uniform routing touches in 64 tokens.
- calibrated: held-out 90% coverage within 2/E of 0.51 (the bisection lands
  on one side of a 1/E step); held-out reuse within 0.03 of 0.25 where the
  stickiness knob reached it (qwen3_moe), else the knob is at its end (ling
  measures 0.17 at b = 1) and the shortfall is recorded. In the bench's short
  window (64 tokens, 256 routings per layer) coverage reads lower than over
  the pooled held-out tokens, so there it is compared with uniform's.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from mlx_edge0.bench.locality import LocalitySummary
from mlx_edge0.bench.synth import SynthOptions, synth_checkpoint
from mlx_edge0.bench.synthetic_router import calibrate_routers, moe_blocks, teacher_forced_trace
from mlx_edge0.checkpoint import text_config
from mlx_edge0.tensorfile import array_bytes, read_header
from test_bench import SMALL

E, K, TOKENS = 64, 4, 64
GEOMETRIES = ("qwen3-30b-a3b", "ling-3.0-tiny")


def options(geometry: str, routing: str) -> SynthOptions:
    layers, overrides = SMALL[geometry]
    return SynthOptions(geometry, layers=layers, overrides={**overrides, "num_experts": E}, routing=routing)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("routers")
    return {
        (g, r): synth_checkpoint(root / f"{g}-{r}", options(g, r), progress=lambda _: None, show_progress=False).path
        for g in GEOMETRIES
        for r in ("random", "uniform", "calibrated")
    }


def bench_view(path: Path) -> tuple[LocalitySummary, dict]:
    model, config = load_model(path, strict=True)
    model.set_dtype(mx.float32)
    vocab = text_config(config)["vocab_size"]
    trace = teacher_forced_trace(model, vocab_size=vocab, prompt_tokens=32, decode_tokens=TOKENS, seed=0)
    return LocalitySummary.of(trace), config["edge0_synthetic"]


def tensors(path: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        header, raw = read_header(f), f.read_bytes()
        out.update({n: raw[e.start : e.end] for n, e in header.entries.items()})
    return out


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_random_is_the_default_and_calibration_only_rewrites_routers(ckpts, tmp_path, geometry):
    default = SynthOptions(**{**options(geometry, "random").__dict__, "routing": "random"})
    plain = synth_checkpoint(tmp_path / "plain", default, progress=lambda _: None).path
    random = tensors(ckpts[geometry, "random"])
    assert tensors(plain) == random
    _, origin = bench_view(ckpts[geometry, "random"])
    assert "routing" not in origin and "router" not in origin
    uniform = tensors(ckpts[geometry, "uniform"])
    changed = {n for n in random if uniform[n] != random[n]}
    assert changed and all(".mlp.gate." in n for n in changed)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_uniform_routing_has_no_locality_beyond_chance(ckpts, geometry):
    summary, origin = bench_view(ckpts[geometry, "uniform"])
    router = origin["router"]
    assert origin["routing"] == router["routing"] == "uniform"
    assert all(r["popularity"] == r["sticky"] == 0 for r in router["layers"])
    assert all(abs(r["reuse"] - K / E) < 0.08 for r in router["layers"])
    assert all(abs(r - K / E) < 0.08 for r in summary.reuse)
    expected_distinct = E * (1 - (1 - K / E) ** TOKENS)
    assert min(summary.distinct) >= 0.85 * expected_distinct


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_calibrated_routing_reaches_the_published_coverage(ckpts, geometry):
    summary, origin = bench_view(ckpts[geometry, "calibrated"])
    uniform, _ = bench_view(ckpts[geometry, "uniform"])
    router = origin["router"]
    assert router["target_coverage90"] == 0.51 and router["target_reuse"] == 0.25
    for r in router["layers"]:
        assert abs(r["coverage90"] - 0.51) <= 2 / E
        assert abs(r["reuse"] - 0.25) < 0.03 or (r["sticky"] > 0.99 and r["reuse"] < 0.25)
    assert summary.mean("coverage90") < uniform.mean("coverage90") - 0.15
    assert summary.mean("reuse") > uniform.mean("reuse") + 0.05
    assert np.isfinite(summary.mean("distinct"))


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_calibration_with_layers_released_sets_the_routers_every_layer_resident_sets(ckpts, geometry):
    """synth releases each layer once the calibration forward is past it (a
    full-depth 35B does not fit at once); the random checkpoint calibrated with
    every layer resident gets the same router bytes."""
    path = ckpts[geometry, "random"]
    model, config = load_model(path, strict=True)
    model.set_dtype(mx.float32)
    reloaded: dict[int, dict[str, mx.array]] = {}

    def release(layer: int) -> None:  # as synth's: the layer's tensors, by the checkpoint's names
        loaded = [(n, v) for f in sorted(path.glob("*.safetensors")) for n, v in mx.load(str(f)).items()]
        fresh = {n: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for n, v in loaded}
        reloaded[layer] = {n: v for n, v in fresh.items() if f".layers.{layer}." in n}
        model.load_weights(list(reloaded[layer].items()), strict=False)

    vocab = text_config(config)["vocab_size"]
    _, stored = calibrate_routers(model, "uniform", vocab_size=vocab, show_progress=False, release=release)
    assert list(reloaded) == list(range(moe_blocks(model)[-1][0]))
    # Every reloaded tensor landed (none nested out of reach): a released layer holds no array
    # the calibration forward evaluated.
    held = dict(tree_flatten(model.parameters()))
    assert all(held[n] is v for fresh in reloaded.values() for n, v in fresh.items())
    written = tensors(ckpts[geometry, "uniform"])
    assert stored and all(array_bytes(v).tobytes() == written[n] for n, v in stored.items())


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="unknown routing 'zipf'"):
        SynthOptions("qwen3-30b-a3b", routing="zipf")
