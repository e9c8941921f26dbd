"""One rank of a parallel test run: ``mlx.launch -n N -- python parallel_worker.py SPEC OUT``.

For every run in the JSON ``SPEC`` (name, checkpoint, options, prompt ids,
tokens) it loads the checkpoint as this rank's share (one process: the whole
model), records the prompt's logits, greedy tokens and their log-probs, the
experts the store read and the rows and bytes of the embedding and LM head it
holds, and writes ``OUT/<name>-rank<r>.npz``. A run that fails to load writes
its error instead (``OUT/<name>-rank<r>.error``). The tests import
:func:`run_one` to make the one-process reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

import mlx_edge0
from mlx_edge0.parallel import settle


def run_one(run: dict, group: Optional[Any]) -> dict[str, np.ndarray]:
    """Load, forward the prompt, decode greedily; what the tests compare."""
    checkpoint = run["checkpoint"]  # or one per rank
    if isinstance(checkpoint, list):
        checkpoint = checkpoint[group.rank()]
    if run.get("loader") == "mlx_lm.sharded_load":  # stock mlx-lm's way (mlx_lm.server under mlx.launch)
        from mlx_lm.utils import sharded_load

        model, _ = sharded_load(checkpoint, tensor_group=group, trust_remote_code=True)
        model.limit_buffer_cache()
    else:
        model = mlx_edge0.load_model(checkpoint, group=group, **run.get("options", {}))
    telemetry = model.edge0_runtime.telemetry
    telemetry.read_trace = []
    ids = mx.array(run["prompt"])
    prompt_logits = model(ids[None])
    mx.eval(prompt_logits)  # every rank evaluates its collectives in the same order
    tokens, logprobs = [], []
    cache = make_prompt_cache(model)
    for token, lp in generate_step(ids, model, max_tokens=run["tokens"], prompt_cache=cache):
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)))
    # generate_step leaves a step ahead running: it ends first (its collectives on every rank)
    if group is None:
        mx.synchronize(generation_stream)
    else:
        settle(group)
    read = np.array(sorted({(layer, e) for layer, ids in telemetry.read_trace for e in ids}), np.int64)
    stats = model.stats()
    return {
        "prompt_logits": np.array(prompt_logits.astype(mx.float32)),
        "tokens": np.array(tokens, np.int64),
        "logprobs": np.stack(logprobs),
        "read": read.reshape(-1, 2),
        "bytes_read": np.array(stats["bytes_read"]),
        "prerouted": np.array(stats["prerouted"]),
        "open_layers": np.array(sorted(model.edge0_runtime.store.layers), np.int64),
        "memory_sharers": np.array(model.edge0_runtime.memory_sharers),
        "vocab_rows": vocab_rows(model),
        "vocab_bytes": np.array(stats["resident_bytes"]["vocab"]),
    }


def vocab_rows(model: Any) -> np.ndarray:
    """The distinct row counts of every tensor of the embedding and LM head the model holds."""
    return np.array(sorted({v.shape[0] for m in model.vocab_modules() for _, v in tree_flatten(m.parameters())}))


def main(spec_file: str, out_dir: str) -> None:
    group = mx.distributed.init()
    out = Path(out_dir)
    for run in json.loads(Path(spec_file).read_text()):
        stem = out / f"{run['name']}-rank{group.rank()}"
        try:
            result = run_one(run, group)
        except ValueError as e:
            stem.with_suffix(".error").write_text(str(e))
            continue
        np.savez(stem.with_suffix(".npz"), **result)


if __name__ == "__main__":
    main(*sys.argv[1:])
