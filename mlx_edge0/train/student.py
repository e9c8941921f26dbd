"""The student-path forward: whole sequences through an edge0 model, routed as served.

Training and evaluation run the model on whole sequences at once, but must
compute what serving computes when the same tokens are decoded one by one
with the prerouter on. The convention, per sequence (pinned by a test against
step-by-step decoding through the model's ``make_cache``):

- positions ``t < gate_positions`` route every MoE layer with its own gate
  (the first token of a fresh cache has no prediction);
- at ``t >= gate_positions`` each consumer layer ``c`` routes with its owner
  head's output made at ``t - 1``: ``head(h_N[t-1], on_N[t-1], on_N[t-2])``
  (``on_N[-1] = 0``), fed to ``c``'s own routing math; layers without an
  owner (the first MoE layer) route with their gate;
- ``h_N`` is layer N's MoE input and ``on_N[t]`` the one-hot of the routing
  layer N actually used at t (its prediction, for an owner that is itself a
  consumer) — the student's own hidden states and routing, never the base's.

Serving is ``gate_positions=1`` whatever the prompt: decoding token by token
from a fresh cache, and a prompt in chunks of any size, since prompt chunks
route with the predictions too (see :mod:`mlx_edge0.prerouting`).

A :class:`StudentPath` is the model's expert source for the forwards it runs
(``runtime.training_forward``): the blocks route themselves with their gates
and it substitutes the predictions (:meth:`StudentPath.mix`), then computes
the experts (:meth:`StudentPath.experts`).

Experts are the checkpoint's int4 tensors held resident (tiny models only;
nothing streams): ``gather_qmm`` on the int4 reconstruction, the same
products serving computes. Gradients reach every trainable parameter (the
LoRA) through hidden states, routing weights and the (frozen) heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..expert_math import ExpertWeights, expert_glu
from ..prerouter_heads import PrerouterHead, topk_onehot
from ..prerouting import Plan
from ..streaming import StreamingMoE


@dataclass(frozen=True)
class LayerTrace:
    """One MoE layer's view of a forward (recorded on request)."""

    x: mx.array  # [B, L, D] the block's input (post-attention norm)
    gate_logits: mx.array  # [B, L, E] its own router on x
    inds: mx.array  # [B, L, K] the routing it used


def resident_experts(model: nn.Module) -> dict[int, ExpertWeights]:
    """Every MoE layer's experts read whole into memory (row e = expert e)."""
    runtime = model.edge0_runtime
    n = model.edge0_section.experts.num_experts
    return {
        layer: runtime.store.read(layer, range(n), runtime.compute_dtype) for layer in model.edge0_section.moe_layers
    }


def served_heads(model: nn.Module) -> dict[int, PrerouterHead]:
    """The heads the model serves with (empty with the prerouter off or absent)."""
    prerouting = model.edge0_runtime.prerouting
    return dict(prerouting.heads) if prerouting is not None else {}


def shift_right(a: mx.array) -> mx.array:
    """[B, L, ...] -> position t holds a[t-1]; zeros at t=0."""
    return mx.concatenate([mx.zeros_like(a[:, :1]), a[:, :-1]], axis=1)


class StudentPath:
    """Whole-sequence forwards of ``model`` with ``heads`` routing as served.

    ``heads`` maps owner MoE layer -> head predicting the next MoE layer
    (default: the heads the model serves with; ``{}``: exact gate routing).
    """

    def __init__(
        self,
        model: nn.Module,
        heads: Optional[dict[int, PrerouterHead]] = None,
        experts: Optional[dict[int, ExpertWeights]] = None,
    ):
        self.model = model
        self.heads = served_heads(model) if heads is None else dict(heads)
        layers = list(model.edge0_section.moe_layers)
        self.consumer_of = {o: layers[layers.index(o) + 1] for o in self.heads}
        self.owner_of = {c: o for o, c in self.consumer_of.items()}
        self.num_experts = model.edge0_section.experts.num_experts
        self.routes = {
            i: layer.mlp.route for i, layer in enumerate(model.layers) if isinstance(layer.mlp, StreamingMoE)
        }
        self.expert_weights = experts if experts is not None else resident_experts(model)
        self.gate_positions: Union[int, mx.array] = 1
        self.seen: dict[int, tuple[mx.array, mx.array]] = {}
        self.trace: Optional[dict[int, LayerTrace]] = None

    def __call__(self, tokens: mx.array, gate_positions: Union[int, mx.array] = 1, record: bool = False) -> mx.array:
        """Logits ``[B, L, V]`` for ``tokens`` ``[B, L]``.

        Args:
            gate_positions: leading positions routed by the gates (>= 1), one
                for all rows or ``[B]``.
            record: keep a :class:`LayerTrace` per MoE layer in ``self.trace``.
        """
        if isinstance(gate_positions, int) and gate_positions < 1:
            raise ValueError(f"gate_positions must be >= 1, got {gate_positions}")
        self.gate_positions = gate_positions
        self.seen = {}
        self.trace = {} if record else None
        with self.model.edge0_runtime.training_forward(self):
            return self.model(tokens)

    def predicted_positions(self, batch: int, length: int) -> mx.array:
        """[B, L, 1] True where a consumer routes with the prediction."""
        start = mx.broadcast_to(mx.array(self.gate_positions), (batch,))
        return (mx.arange(length)[None, :] >= start[:, None])[..., None]

    def begin(self, layer: int, x: mx.array) -> Optional[Plan]:
        """Nothing is planned ahead: every call routes from its gate (:meth:`mix`)."""
        return None

    def mix(
        self, layer: int, x: mx.array, logits: mx.array, inds: mx.array, scores: mx.array
    ) -> tuple[mx.array, mx.array]:
        """A consumer's predicted positions take its owner head's prediction."""
        # x: [B, L, D]; logits, predicted: [B, L, E]; inds, scores: [B, L, K]
        owner = self.owner_of.get(layer)
        if owner is not None:
            h, onehots = self.seen.pop(owner)
            predicted = self.heads[owner](h, onehots, shift_right(onehots))  # made at t, for t+1
            p_inds, p_scores = self.routes[layer](shift_right(predicted))
            use = self.predicted_positions(x.shape[0], x.shape[1])
            inds, scores = mx.where(use, p_inds, inds), mx.where(use, p_scores, scores)
        if self.trace is not None:
            self.trace[layer] = LayerTrace(x, logits, inds)
        return inds, scores

    def experts(self, layer: int, x: mx.array, inds: mx.array, plan: Optional[Plan]) -> mx.array:
        """``[B, L, K, D]`` from the resident experts; owners keep what their head reads."""
        y = expert_glu(x, inds, self.expert_weights[layer])
        if layer in self.consumer_of:
            self.seen[layer] = (x, topk_onehot(inds, self.num_experts))
        return y
