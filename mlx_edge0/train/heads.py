"""Phase 1: train the prerouter heads to predict the next layer's true router.

The served model (int4 experts, exact routing, base frozen) runs on train
windows; for each owner layer N and its consumer c the features are N's MoE
input ``h[t]`` and its router's one-hots at t and t-1 (teacher forced: the
base router's, not the heads'), and the target is c's own router logits at
t+1. Only the heads train, from their warm start ("the next router applied
to the current hidden", the free baseline), on

    loss = KL(softmax(target) || softmax(head)) + mse_weight * mean((head - target)^2)

(KL fits the routing distribution; the MSE pins the logit level, which
sigmoid routers' selection depends on). Reported on held-out windows for
the trained and the warm-started heads: top-k recall (the consumer's own
routing math on both logits) and the KL.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..prerouter_heads import PREROUTER_FILE, PrerouterHead, PrerouterSpec, init_heads, save_heads, topk_onehot
from .data import TokenBatches
from .loop import run_loop
from .phases import PhaseOptions, corpus_tokens, held_out_windows, last_loss, load_served, write_report
from .student import StudentPath, shift_right

MSE_WEIGHT = 0.1


class HeadSet(nn.Module):
    """The heads as one trainable module (parameters ``heads.{owner}.*``, as in the file)."""

    def __init__(self, heads: dict[int, PrerouterHead]):
        super().__init__()
        self.heads = {str(owner): head for owner, head in sorted(heads.items())}

    def as_dict(self) -> dict[int, PrerouterHead]:
        return {int(owner): head for owner, head in self.heads.items()}


@dataclass(frozen=True)
class HeadFeatures:
    """One head's teacher-forced inputs and target, positions aligned."""

    h: mx.array  # [B, T-1, D] owner's MoE input at t
    onehot_now: mx.array  # [B, T-1, E] owner's routing at t
    onehot_prev: mx.array  # [B, T-1, E] owner's routing at t-1
    target: mx.array  # [B, T-1, E] consumer's router logits at t+1


def head_features(student: StudentPath, tokens: mx.array, consumer_of: dict[int, int]) -> dict[int, HeadFeatures]:
    """Exact-routing features of every head for ``tokens`` [B, T], evaluated
    (computed outside the gradient: constants of the heads' loss)."""
    student(tokens, record=True)
    trace, E = student.trace, student.num_experts
    features = {}
    for owner, consumer in consumer_of.items():
        onehots = topk_onehot(trace[owner].inds, E)
        features[owner] = HeadFeatures(
            trace[owner].x[:, :-1],
            onehots[:, :-1],
            shift_right(onehots)[:, :-1],
            trace[consumer].gate_logits[:, 1:],
        )
    mx.eval([vars(f) for f in features.values()])
    return features


def head_losses(head: PrerouterHead, f: HeadFeatures) -> tuple[mx.array, mx.array, mx.array]:
    """(KL, MSE, predicted logits) of one head on its features."""
    predicted = head(f.h, f.onehot_now, f.onehot_prev)
    log_true = nn.log_softmax(f.target.astype(mx.float32), axis=-1)
    log_pred = nn.log_softmax(predicted, axis=-1)
    kl = (mx.exp(log_true) * (log_true - log_pred)).sum(axis=-1).mean()
    mse = mx.square(predicted - f.target).mean()
    return kl, mse, predicted


def topk_recall(route, predicted: mx.array, target: mx.array) -> mx.array:
    """Mean |predicted set ∩ true set| / K, both sets by the consumer's routing math."""
    pred_inds, _ = route(predicted)
    true_inds, _ = route(target)
    E = target.shape[-1]
    hits = (topk_onehot(pred_inds, E) * topk_onehot(true_inds, E)).sum(axis=-1)
    return (hits / true_inds.shape[-1]).mean()


def evaluate_heads(
    heads: dict[int, PrerouterHead], features: list[dict[int, HeadFeatures]], routes: dict[int, object]
) -> dict:
    """Held-out top-k recall and KL, per head and averaged."""
    per_head = {}
    for owner, head in heads.items():
        recall, kl = [], []
        for batch in features:
            k, _, predicted = head_losses(head, batch[owner])
            recall.append(topk_recall(routes[owner], predicted, batch[owner].target).item())
            kl.append(k.item())
        per_head[str(owner)] = {"recall": sum(recall) / len(recall), "kl": sum(kl) / len(kl)}
    return {
        "recall": sum(v["recall"] for v in per_head.values()) / len(per_head),
        "kl": sum(v["kl"] for v in per_head.values()) / len(per_head),
        "per_head": per_head,
    }


def train_heads(options: PhaseOptions, mse_weight: float = MSE_WEIGHT, *, show_progress: bool = True) -> dict:
    """Phase 1 on ``options.checkpoint``; writes prerouter.safetensors into it.

    The heads are made for the K the checkpoint's consumer layers route with
    (its heads' K; for another K, ``edge0 heads init --k K`` first). Returns
    the report (also in the run dir).
    """
    checkpoint = Path(options.checkpoint)
    model = load_served(checkpoint, prerouter=False)
    model.freeze()
    section = model.edge0_section
    spec = PrerouterSpec.default(section.moe_layers, section.consumer_k)
    consumer_of = dict(zip(spec.owners, spec.consumers))
    # the consumers' own routing math (at the heads' K even with the prerouter off)
    routes = {o: model.layers[c].mlp.route for o, c in consumer_of.items()}
    warm = init_heads(model, spec, seed=options.seed)
    head_set = HeadSet(init_heads(model, spec, seed=options.seed))
    exact = StudentPath(model, heads={})
    train = TokenBatches(
        corpus_tokens(checkpoint, "train", options.max_files), options.seq_len, options.batch_size, options.seed
    )
    held = held_out_windows(checkpoint, options)
    held_features = [
        head_features(exact, held[i : i + options.batch_size, :-1], consumer_of)
        for i in range(0, held.shape[0], options.batch_size)
    ]

    def batch_at(step: int) -> dict:
        tokens = train(step)[:, :-1]
        return {"tokens": tokens, "features": head_features(exact, tokens, consumer_of)}

    def loss_fn(module: HeadSet, batch: dict) -> mx.array:
        total = mx.array(0.0)
        for owner, head in module.as_dict().items():
            kl, mse, _ = head_losses(head, batch["features"][owner])
            total = total + kl + mse_weight * mse
        return total / len(consumer_of)

    def eval_fn(module: HeadSet) -> dict:
        return evaluate_heads(module.as_dict(), held_features, routes)

    log = run_loop(head_set, loss_fn, batch_at, options.loop(), "phase 1 heads", eval_fn, show_progress=show_progress)
    trained, baseline = eval_fn(head_set), evaluate_heads(warm, held_features, routes)
    path = save_heads(checkpoint, head_set.as_dict(), spec)
    shutil.copy(path, Path(options.out_dir) / PREROUTER_FILE)
    report = {
        "phase": "heads",
        "k": spec.k,
        "mse_weight": mse_weight,
        "trained": trained,
        "warm_start": baseline,
        "final_loss": last_loss(log),
        "outputs": [str(path)],
    }
    write_report(options, report)
    return report
