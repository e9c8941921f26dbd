"""``edge0 eval``: what int4, prediction-as-routing and the recovery LoRA cost and recover.

On fixed held-out windows of the stdlib corpus (files never trained on),
every row is scored as served — the parallel forward of
:class:`~mlx_edge0.train.student.StudentPath`, equal to decoding the window
token by token from a fresh cache — against the fp teacher:

    fp teacher · int4 exact routing · int4 + warm-start heads ·
    int4 + the checkpoint's heads · + each LoRA given (SFT, distill, the checkpoint's)

It also reports the heads' top-k recall and KL against the free baseline
(the warm start; teacher-forced features as in Phase 1), and how much of
the LoRA delta survives merging it into the int4 weights and requantizing:
``1 - |U - M| / |U - B|`` (U unmerged, M merged, B base), per projection kind
at the weights and at the logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import lora
from .prerouter_heads import PrerouterSpec, init_heads
from .progress import track
from .streaming import dense_weight
from .train.base import load_teacher
from .train.heads import evaluate_heads, head_features
from .train.phases import corpus_tokens, load_served, mean_nll
from .train.student import StudentPath


@dataclass(frozen=True)
class EvalOptions:
    seq_len: int = 128
    windows: int = 32
    batch_size: int = 8
    max_files: int = 0  # held-out files read (evenly spaced; 0 = all)

    def __post_init__(self):
        if self.seq_len < 1 or self.windows < 1 or self.batch_size < 1 or self.max_files < 0:
            raise ValueError(f"seq_len, windows and batch_size must be >= 1 and max_files >= 0, got {self}")


def held_out(checkpoint: Path, options: EvalOptions) -> mx.array:
    from .train.data import eval_windows

    tokens = corpus_tokens(checkpoint, "held_out", options.max_files)
    return mx.array(eval_windows(tokens, options.seq_len, options.windows))


def _row(name: str, nll: float, teacher_nll: Optional[float]) -> dict:
    row = {"row": name, "nll": nll, "ppl": math.exp(nll)}
    if teacher_nll is not None:
        row["ppl_gap_vs_teacher"] = math.exp(nll) - math.exp(teacher_nll)
    return row


def merge_survival(model: nn.Module, forward, windows: mx.array, batch_size: int) -> dict:
    """Fraction of the LoRA delta surviving merge + requantize, per kind and at the logits."""
    modules = lora.lora_modules(model)
    kinds = lora.lora_targets(model)
    sums: dict[str, list[float]] = {}
    merged = {}
    for path, m in modules.items():
        base = dense_weight(m.linear)
        fused = m.fuse(dequantize=False)  # merged into the weights, requantized like the base
        unmerged = base + (m.scale * m.lora_b.T @ m.lora_a.T).astype(base.dtype)
        gone, delta = mx.square(unmerged - dense_weight(fused)).sum(), mx.square(unmerged - base).sum()
        acc = sums.setdefault(kinds[path], [0.0, 0.0])
        acc[0] += gone.item()
        acc[1] += delta.item()
        merged[path] = fused
    weights = {k: 1 - math.sqrt(g) / math.sqrt(d) if d > 0 else None for k, (g, d) in sums.items()}
    unmerged_logits = _logits(forward, windows, batch_size)
    model.update_modules(tree_unflatten(list(merged.items())))
    merged_logits = _logits(forward, windows, batch_size)
    model.update_modules(tree_unflatten([(p, m.linear) for p, m in modules.items()]))
    base_logits = _logits(forward, windows, batch_size)
    model.update_modules(tree_unflatten(list(modules.items())))
    gone = mx.sqrt(mx.square(unmerged_logits - merged_logits).sum()).item()
    delta = mx.sqrt(mx.square(unmerged_logits - base_logits).sum()).item()
    return {"weights": weights, "logits": 1 - gone / delta if delta > 0 else None}


def _logits(forward, windows: mx.array, batch_size: int) -> mx.array:
    out = [forward(windows[i : i + batch_size, :-1]) for i in range(0, windows.shape[0], batch_size)]
    mx.eval(out)
    return mx.concatenate(out)


def evaluate(
    checkpoint: Path,
    teacher: Optional[Path] = None,
    adapters: Optional[dict[str, Path]] = None,
    options: EvalOptions = EvalOptions(),
    log=print,
    *,
    show_progress: bool = True,
) -> dict:
    """The table (see the module docstring) as a JSON-able dict.

    ``adapters``: row label -> adapter dir (e.g. {"SFT LoRA": run2, "distill LoRA": run3});
    the checkpoint's own adapters get a row of their own when it has them.
    ``log`` gets each row's perplexity; ``show_progress`` draws a bar on
    stderr while each row is scored.
    """
    checkpoint = Path(checkpoint)
    windows = held_out(checkpoint, options)

    def score(forward, name: str) -> float:
        return mean_nll(forward, windows, options.batch_size, label=f"eval: {name}" if show_progress else None)

    rows, teacher_nll = [], None
    if teacher is not None:
        teacher_model = load_teacher(teacher)
        teacher_nll = score(teacher_model, "fp teacher")
        rows.append(_row("fp teacher", teacher_nll, teacher_nll))
        del teacher_model
        log(f"eval: fp teacher ppl {rows[-1]['ppl']:.3f}")
    model = load_served(checkpoint, lora=False)
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.consumer_k)
    exact = StudentPath(model, heads={})
    warm = init_heads(model, spec)
    variants = [
        ("int4, exact routing", exact),
        ("int4 + warm-start heads", StudentPath(model, warm, exact.expert_weights)),
    ]
    served = StudentPath(model, experts=exact.expert_weights)
    if served.heads:
        variants.append(("int4 + checkpoint heads", served))
    for name, student in variants:
        rows.append(_row(name, score(lambda x, s=student: s(x), name), teacher_nll))
        log(f"eval: {name} ppl {rows[-1]['ppl']:.3f}")
    sets = dict(adapters or {})
    if lora.has_adapters(checkpoint) and not any(_same_adapters(checkpoint, d) for d in sets.values()):
        sets["checkpoint LoRA"] = checkpoint
    merge = {}
    prefix = "int4 + heads" if served.heads else "int4"
    for name, directory in sets.items():
        lora.apply_adapters(model, directory)
        forward = lambda x: served(x)  # noqa: E731
        rows.append(_row(f"{prefix} + {name}", score(forward, f"{prefix} + {name}"), teacher_nll))
        log(f"eval: + {name} ppl {rows[-1]['ppl']:.3f}")
        merge[name] = merge_survival(model, forward, windows[: options.batch_size], options.batch_size)
        lora.detach(model)
    consumer_of = dict(zip(spec.owners, spec.consumers))
    batches = range(0, windows.shape[0], options.batch_size)
    features = [
        head_features(exact, windows[i : i + options.batch_size, :-1], consumer_of)
        for i in track(batches, "eval: head recall", unit="batch", show=show_progress)
    ]
    routes = {o: model.layers[c].mlp.route for o, c in consumer_of.items()}
    recall = {"warm_start": evaluate_heads(warm, features, routes)}
    if served.heads:
        recall["checkpoint"] = evaluate_heads(served.heads, features, routes)
    return {
        "checkpoint": str(checkpoint),
        "teacher": str(teacher) if teacher else None,
        "held_out": {
            "windows": int(windows.shape[0]),
            "seq_len": options.seq_len,
            "tokens": int(windows[:, 1:].size),
            "max_files": options.max_files,
        },
        "rows": rows,
        "gap_closed": gap_closed(rows),
        "head_recall": recall,
        "merge_survival": merge,
    }


def _same_adapters(a: Path, b: Path) -> bool:
    files = (lora.ADAPTERS_FILE, lora.ADAPTER_CONFIG_FILE)
    return all((Path(a) / f).read_bytes() == (Path(b) / f).read_bytes() for f in files)


def gap_closed(rows: list[dict]) -> dict[str, float]:
    """For each LoRA row: the share of the (int4 + heads) - teacher perplexity gap it closes."""
    by_name = {r["row"]: r["ppl"] for r in rows}
    teacher = by_name.get("fp teacher")
    heads = by_name.get("int4 + checkpoint heads", by_name.get("int4 + warm-start heads"))
    if teacher is None or heads is None or heads == teacher:
        return {}
    return {r["row"]: (heads - r["ppl"]) / (heads - teacher) for r in rows if "LoRA" in r["row"]}


def format_table(result: dict) -> str:
    lines = ["| row | ppl | NLL | ppl gap vs teacher |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        gap = f"{r['ppl_gap_vs_teacher']:+.3f}" if "ppl_gap_vs_teacher" in r else "-"
        lines.append(f"| {r['row']} | {r['ppl']:.3f} | {r['nll']:.4f} | {gap} |")
    lines.append("")
    for name, share in result["gap_closed"].items():
        lines.append(f"{name}: closes {100 * share:.1f}% of the int4+heads vs teacher perplexity gap")
    for name, h in result["head_recall"].items():
        lines.append(f"heads ({name}): top-k recall {h['recall']:.4f}, KL {h['kl']:.4f}")
    for name, m in result["merge_survival"].items():
        kinds = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(m["weights"].items()) if v is not None)
        logits = f"{100 * m['logits']:.1f}%" if m["logits"] is not None else "-"
        lines.append(f"merge-and-requantize survival ({name}): {kinds}; logits {logits}")
    return "\n".join(lines)


def write_result(result: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
