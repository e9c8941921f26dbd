"""Memory of the stock mlx_lm.server serving an edge0 checkpoint, measured
inside the server process: one long streamed generation, then many sequential
requests, then rounds of concurrent ones.

The server runs as ``edge0 serve`` runs it (``mlx_edge0.pinned_server``: the
stock server pinned to the checkpoint), but in a thread of this process, so
MLX's counters (active, peak, buffer cache) and this process's RSS are the
server's own. Requests go through the real ``openai`` client (test extra).
Without ``--model`` a tiny qwen3_next checkpoint with prerouter heads and LoRA
adapters is built in a temp dir.

    python benchmarks/serve_memory.py [--model CKPT] [--tokens 2000] [--requests 50]
        [--concurrency 8] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [
    "def main():",
    "import os\nimport sys\n",
    "class Parser:\n    def",
    "for i in range(",
    "with open(path) as f:",
    "try:\n    x = ",
    "return sorted(",
    "@dataclass\nclass",
    "if __name__ ==",
    "async def fetch(",
]


def rss() -> dict:
    """This process's resident set now and at its peak (bytes)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return {"rss": fields.get("VmRSS", 0), "rss_peak": fields.get("VmHWM", 0)}


def snapshot(label: str, **extra) -> dict:
    import mlx.core as mx

    return {
        "at": label,
        "mlx_active": mx.get_active_memory(),
        "mlx_peak": mx.get_peak_memory(),
        "mlx_cache": mx.get_cache_memory(),
        **rss(),
        **extra,
    }


def tiny_checkpoint(root: Path) -> Path:
    """A tiny qwen3_next edge0 checkpoint with warm-started heads and LoRA
    adapters (random non-zero B), so both run while serving."""
    import mlx.core as mx

    import mlx_edge0
    from mlx_edge0 import lora, tiny
    from mlx_edge0.conversions import ConvertOptions, convert
    from mlx_edge0.prerouter_heads import PrerouterSpec, init_heads, save_heads

    model, config = tiny.build_tiny_model("qwen3_next", seed=0)
    tiny.save_mlx(model, config, root / "source", tiny.train_tokenizer(root / "tokenizer"), bits=4)
    ckpt = root / "ckpt"
    convert(root / "source", ckpt, ConvertOptions(show_progress=False))
    model = mlx_edge0.load_model(ckpt, compute_dtype="float32", cache_gib=0, prerouter=False)
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.num_experts_per_tok)
    save_heads(ckpt, init_heads(model, spec), spec)
    model = mlx_edge0.load_model(ckpt, cache_gib=0)
    mx.random.seed(3)
    lora.attach(model, tuple(lora.lora_targets(model)))
    for m in lora.lora_modules(model).values():
        m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    lora.save_adapters(ckpt, model, ckpt, lora.consumer_k(model))
    return ckpt


def start_server(ckpt: Path, port: int) -> str:
    """The server ``edge0 serve`` runs (pinned to ``ckpt``), in a daemon thread."""
    from mlx_edge0.options import Options
    from mlx_edge0.pinned_server import ServingSpec, serve

    spec = ServingSpec(str(ckpt.resolve()), Options().to_dict(), "127.0.0.1", port, max_prompt_tokens=0)
    threading.Thread(target=serve, args=(spec, ["--log-level", "WARNING"]), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("server did not start")


def control_generation(ckpt: Path, tokens: int) -> list[dict]:
    """The runtime alone: greedy decode in this process (the server sits
    idle), with the KV cache's own bytes recorded, so growth that is not KV
    shows as ``mlx_active - kv``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_edge0

    model = mlx_edge0.load_model(ckpt)
    cache = make_prompt_cache(model)
    steps = generate_step(mx.array([5, 17, 99, 3]), model, max_tokens=tokens, prompt_cache=cache)
    out = []
    for i, _ in enumerate(steps, 1):
        if i == 250 or i % max(1, tokens // 4) == 0:
            out.append(snapshot(f"control: {i} tokens", kv=sum(c.nbytes for c in cache), tokens=i))
    return out


def complete(client, prompt: str, max_tokens: int, **kw) -> int:
    r = client.completions.create(model="default_model", prompt=prompt, max_tokens=max_tokens, temperature=0.0, **kw)
    return r.usage.completion_tokens


def run(args, command: str) -> dict:
    import mlx.core as mx
    import openai
    from mlx_lm import __version__ as mlx_lm_version

    from mlx_edge0.checkpoint import read_config
    from mlx_edge0.options import Options

    scratch = Path(tempfile.mkdtemp(prefix="serve-memory-"))
    ckpt = args.model or tiny_checkpoint(scratch)
    eos = read_config(ckpt).get("eos_token_id")
    no_eos = {str(e): -100 for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    url = start_server(ckpt, args.port)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="edge0", max_retries=0, timeout=3600)
    samples, tokens_total, requests = [], 0, 0

    complete(client, PROMPTS[0], 8)  # loads the model
    requests += 1
    samples.append(snapshot("loaded"))

    print(f"long generation: {args.tokens} tokens", file=sys.stderr)
    mx.reset_peak_memory()
    start = snapshot("long: start")
    stream = client.completions.create(
        model="default_model",
        prompt=PROMPTS[1],
        max_tokens=args.tokens,
        temperature=0.0,
        stream=True,
        logit_bias=no_eos,
        stream_options={"include_usage": True},
    )
    chunks, long_samples, t0, generated = 0, [start], time.perf_counter(), 0
    for chunk in stream:
        if chunk.usage is not None:
            generated = chunk.usage.completion_tokens
        if chunk.choices:
            chunks += 1
            if chunks % max(1, args.tokens // 8) == 0:
                long_samples.append(snapshot(f"long: {chunks} chunks"))
                print(f"  {chunks} chunks", file=sys.stderr)
    long_s = time.perf_counter() - t0
    long_samples.append(snapshot("long: end", tokens=generated))
    tokens_total += generated
    requests += 1
    samples += long_samples

    print(f"{args.requests} sequential requests", file=sys.stderr)
    mx.reset_peak_memory()
    seq = []
    t0 = time.perf_counter()
    for i in range(args.requests):
        prompt = f"# request {i}\n{PROMPTS[i % len(PROMPTS)]}"
        tokens_total += complete(client, prompt, args.request_tokens)
        requests += 1
        if (i + 1) in (1, 10, 25, args.requests) or (i + 1) % 10 == 0:
            seq.append(snapshot(f"sequential: {i + 1}"))
            print(f"  {i + 1} requests", file=sys.stderr)
    seq_s = time.perf_counter() - t0
    samples += seq

    print(f"{args.rounds} rounds of {args.concurrency} concurrent requests", file=sys.stderr)
    conc_tokens = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for r in range(args.rounds):
            prompts = [f"# round {r} client {c}\n{PROMPTS[c % len(PROMPTS)]}" for c in range(args.concurrency)]
            conc_tokens += sum(pool.map(lambda p: complete(client, p, args.request_tokens), prompts))
            requests += args.concurrency
            samples.append(snapshot(f"concurrent: round {r + 1}"))
    conc_s = time.perf_counter() - t0
    tokens_total += conc_tokens

    print(f"control: {args.tokens} tokens in-process", file=sys.stderr)
    control = control_generation(ckpt, args.tokens)
    samples += control

    first_seq = next(s for s in seq if s["at"] == "sequential: 10")
    return {
        "checkpoint": str(ckpt),
        "command": command,
        "mlx_lm": mlx_lm_version,
        "options": Options().to_dict(),
        "requests_served": requests,
        "tokens_generated": tokens_total,
        "long_generation": {
            "tokens": generated,
            "seconds": round(long_s, 2),
            "mlx_active_growth": long_samples[-1]["mlx_active"] - start["mlx_active"],
            "rss_growth": long_samples[-1]["rss"] - start["rss"],
        },
        "sequential": {
            "requests": args.requests,
            "tokens_each": args.request_tokens,
            "seconds": round(seq_s, 2),
            "mlx_active_growth_10_to_last": seq[-1]["mlx_active"] - first_seq["mlx_active"],
            "rss_growth_10_to_last": seq[-1]["rss"] - first_seq["rss"],
        },
        "control": {
            "tokens": args.tokens,
            "from_token": control[0]["tokens"],
            "kv_growth": control[-1]["kv"] - control[0]["kv"],
            "mlx_active_growth": control[-1]["mlx_active"] - control[0]["mlx_active"],
            "mlx_active_minus_kv_growth": (control[-1]["mlx_active"] - control[-1]["kv"])
            - (control[0]["mlx_active"] - control[0]["kv"]),
            "rss_growth": control[-1]["rss"] - control[0]["rss"],
        },
        "concurrent": {
            "clients": args.concurrency,
            "rounds": args.rounds,
            "tokens": conc_tokens,
            "seconds": round(conc_s, 2),
        },
        "samples": samples,
    }


def table(result: dict) -> str:
    mib = 1 << 20
    rows = [
        "| at | MLX active MiB | MLX peak MiB | MLX cache MiB | KV MiB | RSS MiB | RSS peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["samples"]:
        kv = f"{s['kv'] / mib:.2f}" if "kv" in s else ""
        rows.append(
            f"| {s['at']} | {s['mlx_active'] / mib:.2f} | {s['mlx_peak'] / mib:.2f} | "
            f"{s['mlx_cache'] / mib:.2f} | {kv} | {s['rss'] / mib:.1f} | {s['rss_peak'] / mib:.1f} |"
        )
    lg, sq, cc, ct = result["long_generation"], result["sequential"], result["concurrent"], result["control"]
    rows += [
        "",
        f"requests served {result['requests_served']}, tokens generated {result['tokens_generated']}",
        f"long generation: {lg['tokens']} tokens in {lg['seconds']} s; MLX active "
        f"{lg['mlx_active_growth'] / mib:+.2f} MiB, RSS {lg['rss_growth'] / mib:+.1f} MiB",
        f"sequential: {sq['requests']} x {sq['tokens_each']} tokens in {sq['seconds']} s; from request 10 "
        f"to {sq['requests']}: MLX active {sq['mlx_active_growth_10_to_last'] / mib:+.2f} MiB, "
        f"RSS {sq['rss_growth_10_to_last'] / mib:+.1f} MiB",
        f"concurrent: {cc['rounds']} rounds x {cc['clients']} clients, {cc['tokens']} tokens in {cc['seconds']} s",
        f"control (runtime alone, in-process): {ct['tokens']} tokens; from token {ct['from_token']}: MLX active "
        f"{ct['mlx_active_growth'] / mib:+.2f} MiB = KV cache {ct['kv_growth'] / mib:+.2f} MiB "
        f"+ other {ct['mlx_active_minus_kv_growth'] / mib:+.2f} MiB; RSS {ct['rss_growth'] / mib:+.1f} MiB",
    ]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="edge0 checkpoint (default: a tiny one)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens of the long generation")
    p.add_argument("--requests", type=int, default=50, help="sequential requests")
    p.add_argument("--request-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=18475)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "serve-memory-qwen3_next-tiny.json")
    args = p.parse_args()
    result = run(args, " ".join(["python", "benchmarks/serve_memory.py", *sys.argv[1:]]))
    print(table(result))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    sys.stdout.flush()
    os._exit(0)  # the server's generation thread is not a daemon and has no public stop


if __name__ == "__main__":
    main()
