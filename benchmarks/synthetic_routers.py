"""Locality of ``edge0 bench synth --routing {random,uniform,calibrated}`` checkpoints,
as the bench sees it: stock mlx-lm (float32) prefills a 32-token seeded random
prompt, then decodes teacher-forced (``run_spec.forced_tokens``, 2 warm-up
steps), recording each decoded token's routed experts per MoE layer
(``synthetic_router.teacher_forced_trace``). Prints a markdown table of
distinct experts per layer, token-to-token reuse and 90% coverage over the
decoded tokens, with the synth time and the part spent setting routers.

    python benchmarks/synthetic_routers.py DATA --geometry qwen3-30b-a3b --layers 2
        [--routings random,uniform,calibrated] [--tokens 32] [--out FILE.json]
    python benchmarks/synthetic_routers.py DATA --default-model [--tokens 256]

Checkpoints are written to DATA/GEOMETRY-LLAYERS-ROUTING (replaced if there).
``--default-model`` synthesizes the embedded default model's geometry (a
qwen3_moe: 6 layers, E=16, K=4, its widths and vocabulary) and puts the
default model itself first: its routing recorded by
``benchmarks/routing_locality.py`` (teacher-forced built-in Python text, 16
prompt tokens), and on random ids as the synthetic rows are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model

from mlx_edge0.bench.locality import LocalitySummary
from mlx_edge0.bench.synth import SynthOptions, synth_checkpoint
from mlx_edge0.bench.synthetic_router import ROUTINGS, teacher_forced_trace
from mlx_edge0.checkpoint import read_config, text_config
from mlx_edge0.default_model import default_checkpoint

PROMPT_TOKENS = 32
DEFAULT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "num_hidden_layers",
)  # fmt: skip


def row(name: str, routing: str, s: LocalitySummary, held: str, seconds: str) -> str:
    return (
        f"| {name} | {routing} | {', '.join(map(str, s.distinct))} | "
        f"{', '.join(f'{r:.2f}' for r in s.reuse)} ({s.mean('reuse'):.3f}) | "
        f"{', '.join(f'{c:.2f}' for c in s.coverage90)} ({s.mean('coverage90'):.3f}) | {held} | {seconds} |"
    )


def default_model_rows(tokens: int) -> list[str]:
    """The embedded default model on text (routing_locality.py) and on random ids."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("routing_locality", Path(__file__).with_name("routing_locality.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["routing_locality"] = module
    spec.loader.exec_module(module)
    text_trace, _ = module.record_trace(default_checkpoint(), tokens)
    rows = [row("default model", "trained (Python text)", LocalitySummary.of(text_trace), "", "")]
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_edge0
    from mlx_edge0.bench.locality import RoutingTrace
    from mlx_edge0.bench.run_spec import WARMUP_STEPS, forced_tokens

    path = default_checkpoint()
    model = mlx_edge0.load_model(path, cache_gib=0, staged=False, prefill="exact", prerouter=False)
    vocab = text_config(read_config(path))["vocab_size"]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(np.random.default_rng(0).integers(0, vocab, PROMPT_TOKENS), mx.int32)[None], cache=cache))
    fed = forced_tokens(vocab, WARMUP_STEPS + tokens, 0)
    for token in fed[:WARMUP_STEPS]:
        mx.eval(model(mx.array([[token]], mx.int32), cache=cache))
    rt = model.edge0_runtime
    rt.telemetry.routing_trace = calls = []
    for token in fed[WARMUP_STEPS:]:
        mx.eval(model(mx.array([[token]], mx.int32), cache=cache))
    trace = RoutingTrace.from_calls(calls, rt.section.experts.num_experts, rt.section.num_experts_per_tok)
    rows.append(row("default model", "trained (random ids)", LocalitySummary.of(trace), "", ""))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", type=Path)
    p.add_argument("--geometry", default="qwen3-30b-a3b")
    p.add_argument("--default-model", action="store_true", help="the default model's geometry, and the model")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--routings", default=",".join(ROUTINGS))
    p.add_argument("--tokens", type=int, default=32, help="teacher-forced decode steps recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as JSON")
    a = p.parse_args()
    rows, runs, overrides, name = [], [], {}, f"{a.geometry} L{a.layers}"
    if a.default_model:
        config = text_config(read_config(default_checkpoint()))
        overrides = {k: config[k] for k in DEFAULT_FIELDS}
        a.geometry, a.layers, name = "qwen3-30b-a3b", config["num_hidden_layers"], "default geometry"
        rows = default_model_rows(a.tokens)
    for routing in a.routings.split(","):
        options = SynthOptions(
            a.geometry, layers=a.layers, seed=a.seed, force=True, routing=routing, overrides=overrides
        )
        out = a.data / (f"default-geometry-{routing}" if a.default_model else f"{a.geometry}-L{a.layers}-{routing}")
        report = synth_checkpoint(out, options)
        model, config = load_model(report.path, strict=True)
        model.set_dtype(mx.float32)
        trace = teacher_forced_trace(
            model, vocab_size=text_config(config)["vocab_size"], prompt_tokens=PROMPT_TOKENS,
            decode_tokens=a.tokens, seed=a.seed,
        )  # fmt: skip
        s = LocalitySummary.of(trace)
        router = config["edge0_synthetic"].get("router")
        runs.append({"routing": routing, "synth_s": report.seconds, "router_s": report.router_seconds,
                     "locality": s.as_dict(), "router": router})  # fmt: skip
        held = f"{router['mean_coverage90']:.3f} / {router['mean_reuse']:.3f}" if router else ""
        rows.append(row(name, routing, s, held, f"{report.seconds:.1f} ({report.router_seconds:.1f})"))
        del model
        print(rows[-1], flush=True)
    print(
        f"\n| checkpoint | routing | distinct experts per MoE layer (of {trace.num_experts}) | reuse (mean) | "
        "90% coverage (mean) | held-out coverage90 / reuse | synth s (routers) |\n|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    if a.out:
        a.out.write_text(json.dumps({"geometry": a.geometry, "layers": a.layers, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
