"""Routing locality of a checkpoint, and what each hot-cache policy makes of it
next to the offline optimum (Belady's MIN) on the same trace and budget.

Records a teacher-forced routing trace: the prompt is prefilled, then a fixed
list of token ids is fed one at a time (no sampling, so the trace depends only
on the checkpoint and the text), on the exact path with the checkpoint's own
routers (``prerouter=False``), through ``runtime.telemetry.routing_trace`` as
benchmarks/hot_policy.py does. The ids are the built-in Python text below
tokenized by the checkpoint's tokenizer, or, for a checkpoint without one
(``edge0 bench synth``), seeded random ids. Then prints and writes:

- locality per MoE layer (``mlx_edge0.bench.locality``): distinct experts,
  token-to-token reuse, top-10% popularity share, 90% coverage, next to what
  uniform routing gives;
- hit rate and device bytes read per token of LRU, LFU, prediction-aware
  LRU/LFU and MIN at several cache sizes (``mlx_edge0.bench.eviction``), and
  each policy's gap to MIN in points; with a tokenizer also ``popularity``:
  a cache that keeps the experts most popular in a profile recorded the same
  way on other text (``--profile-tokens`` of the stdlib files the default
  model never trained on), to see whether a popularity measured in advance
  carries over from one text to another;
- the same cache table for synthetic traces of the same shape
  (``mlx_edge0.bench.synthetic_routing``): ``uniform`` and ``calibrated``.

    python benchmarks/routing_locality.py [CKPT] [--tokens 256] [--fractions 0.125,0.25,0.5]
        [--profile-tokens 1024] [--out FILE.json] [--trace-out TRACE.json] [--profile-trace-out TRACE.json]

Without CKPT it measures the embedded default model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0.bench.eviction import POLICY_NAMES, POPULARITY, CacheResult, Key, ceiling, compare, measured_popularity
from mlx_edge0.bench.locality import LocalitySummary, RoutingTrace
from mlx_edge0.bench.synthetic_routing import LOCALITIES, synthetic_trace
from mlx_edge0.checkpoint import read_config, text_config
from mlx_edge0.default_model import default_checkpoint
from mlx_edge0.train.data import split_corpus

PROMPT_TOKENS = 16
TEXT = '''import os
import re
from collections import defaultdict


class Index:
    """Map words to the files and lines they occur on."""

    def __init__(self, root):
        self.root = root
        self.entries = defaultdict(list)

    def add_file(self, path):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                for word in re.findall(r"\\w+", line.lower()):
                    self.entries[word].append((path, number))

    def build(self):
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".py"):
                    self.add_file(os.path.join(dirpath, name))
        return self

    def lookup(self, word):
        """Return the (path, line) pairs where word occurs."""
        return list(self.entries.get(word.lower(), []))

    def __len__(self):
        return len(self.entries)

    def __repr__(self):
        return "<Index of %r: %d words>" % (self.root, len(self))


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root")
    parser.add_argument("words", nargs="+")
    args = parser.parse_args(argv)
    index = Index(args.root).build()
    for word in args.words:
        for path, number in index.lookup(word):
            print("%s:%d: %s" % (path, number, word))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
'''


def decode_trace(model, ids: list[int], path: Path, text: str) -> RoutingTrace:
    """Prefill ``PROMPT_TOKENS`` of ``ids``, feed the rest one at a time, and
    return the decode steps' routing."""
    rt = model.edge0_runtime
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(ids[:PROMPT_TOKENS], mx.int32)[None], cache=cache))
    rt.telemetry.routing_trace = calls = []  # decode steps only
    for token in ids[PROMPT_TOKENS:]:
        mx.eval(model(mx.array([[token]], mx.int32), cache=cache))
    rt.telemetry.routing_trace = None
    section = rt.section
    source = f"{path} ({text}, {PROMPT_TOKENS} prompt tokens, {len(ids) - PROMPT_TOKENS} teacher-forced)"
    return RoutingTrace.from_calls(calls, section.experts.num_experts, section.num_experts_per_tok, source)


def held_out_ids(tokenizer, count: int) -> list[int]:
    """The first ``count`` tokens of the stdlib files the default model never
    trained on (``mlx_edge0.train.data``'s held-out split), in path order."""
    ids: list[int] = []
    for text in split_corpus().texts("held_out"):
        ids += tokenizer.encode(text)
        if len(ids) >= count:
            return ids[:count]
    raise SystemExit(f"the held-out stdlib files hold {len(ids)} tokens; ask for at most {len(ids) - PROMPT_TOKENS}")


def record_traces(path: Path, tokens: int, profile_tokens: int) -> tuple[RoutingTrace, Optional[RoutingTrace], int]:
    """Teacher-forced decode trace of ``tokens`` steps, the held-out profile
    trace of ``profile_tokens`` steps (None without a tokenizer or when 0),
    and the bundle bytes of one expert."""
    options = dict(cache_gib=0, staged=False, prefill="exact", prerouter=False)
    need = PROMPT_TOKENS + tokens
    profile = None
    if (path / "tokenizer_config.json").is_file():
        model, tokenizer = mlx_edge0.load(path, **options)
        ids = tokenizer.encode(TEXT)
        if len(ids) < need:
            raise SystemExit(f"the built-in text is {len(ids)} tokens; ask for at most {len(ids) - PROMPT_TOKENS}")
        trace = decode_trace(model, ids[:need], path, "built-in Python text")
        if profile_tokens:
            held_out = held_out_ids(tokenizer, PROMPT_TOKENS + profile_tokens)
            profile = decode_trace(model, held_out, path, "held-out stdlib files")
    else:  # a synthetic checkpoint has no tokenizer
        model = mlx_edge0.load_model(path, **options)
        vocab = text_config(read_config(path))["vocab_size"]
        ids = np.random.default_rng(0).integers(0, vocab, need).tolist()
        trace = decode_trace(model, ids, path, "random ids, seed 0")
    return trace, profile, model.edge0_runtime.section.experts.bundle_bytes


def capacities(trace: RoutingTrace, fractions: list[float]) -> list[int]:
    total = len(trace.layers) * trace.num_experts
    return sorted({max(trace.k, round(f * total)) for f in fractions})


def locality_table(summary: LocalitySummary, layers: tuple[int, ...]) -> str:
    rows = ["| MoE layer | distinct experts | reuse t→t+1 | top-10% share | 90% coverage |", "|---|---|---|---|---|"]
    for i, layer in enumerate(layers):
        rows.append(
            f"| {layer} | {summary.distinct[i]} | {summary.reuse[i]:.3f} | "
            f"{summary.top_share[i]:.3f} | {summary.coverage90[i]:.3f} |"
        )
    rows.append(
        f"| mean | {summary.mean('distinct'):.1f} | {summary.mean('reuse'):.3f} | "
        f"{summary.mean('top_share'):.3f} | {summary.mean('coverage90'):.3f} |"
    )
    rows.append(f"| uniform | | {summary.uniform_reuse:.3f} | {summary.uniform_top_share:.3f} | 0.900 |")
    return "\n".join(rows)


def cache_table(results: list[CacheResult], total: int, ceil: float) -> str:
    names = [p for p in POLICY_NAMES if p != "min"]
    names += [POPULARITY] if any(r.policy == POPULARITY for r in results) else []
    head = "| slots (of all) | " + " | ".join(names) + " | MIN | unbounded | gap to MIN (points) | MIN KiB/token |"
    rows = [head, "|" + "---|" * (len(names) + 5)]
    by = {(r.capacity, r.policy): r for r in results}
    for c in sorted({r.capacity for r in results}):
        best = by[c, "min"]
        gaps = ", ".join(f"{p} {100 * (best.hit_rate - by[c, p].hit_rate):.1f}" for p in names)
        rows.append(
            f"| {c} ({c / total:.0%}) | "
            + " | ".join(f"{by[c, p].hit_rate:.3f}" for p in names)
            + f" | {best.hit_rate:.3f} | {ceil:.3f} | {gaps} | {best.bytes_per_token / 1024:.1f} |"
        )
    return "\n".join(rows)


def report(
    name: str, trace: RoutingTrace, caps: list[int], bundle: int, popularity: Optional[dict[Key, float]] = None
) -> dict:
    summary = LocalitySummary.of(trace)
    results = compare(trace, caps, bundle_bytes=bundle)
    if popularity is not None:
        results += compare(trace, caps, [POPULARITY], bundle_bytes=bundle, popularity=popularity)
    total = len(trace.layers) * trace.num_experts
    print(
        f"\n## {name}: {len(trace.tokens)} tokens, {len(trace.layers)} MoE layers, E={trace.num_experts}, K={trace.k}\n"
    )
    print(locality_table(summary, trace.layers) + "\n")
    print(cache_table(results, total, ceiling(trace)))
    return {
        "name": name,
        "source": trace.source,
        "tokens": len(trace.tokens),
        "layers": list(trace.layers),
        "num_experts": trace.num_experts,
        "k": trace.k,
        "bundle_bytes": bundle,
        "locality": summary.as_dict(),
        "ceiling": ceiling(trace),
        "results": [r.as_dict() for r in results],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, nargs="?", help="an edge0 checkpoint (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=256, help="decode steps to record")
    p.add_argument("--fractions", default="0.125,0.25,0.5", help="cache sizes as fractions of all experts")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    p.add_argument("--trace-out", type=Path, help="write the recorded trace as JSON")
    p.add_argument("--profile-trace-out", type=Path, help="write the held-out profile's trace as JSON")
    p.add_argument(
        "--profile-tokens",
        type=int,
        default=1024,
        help="decode steps of held-out stdlib text whose expert popularity the popularity policy keeps (0: none)",
    )
    a = p.parse_args()
    path = a.checkpoint or default_checkpoint()
    trace, profile, bundle = record_traces(path, a.tokens, a.profile_tokens)
    if a.trace_out:
        trace.save(a.trace_out)
    if a.profile_trace_out and profile is not None:
        profile.save(a.profile_trace_out)
    caps = capacities(trace, [float(f) for f in a.fractions.split(",")])
    popularity = None if profile is None else measured_popularity(profile)
    runs = [report("recorded", trace, caps, bundle, popularity)]
    if profile is not None:
        runs[0] |= {"profile": profile.source, "profile_locality": LocalitySummary.of(profile).as_dict()}
    for locality in LOCALITIES:
        synthetic = synthetic_trace(
            trace.layers, trace.num_experts, trace.k, len(trace.tokens), locality=locality, seed=0
        )
        runs.append(report(f"synthetic {locality}", synthetic, caps, bundle))
    if a.out:
        a.out.write_text(json.dumps({"checkpoint": str(path), "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
