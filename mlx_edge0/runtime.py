"""StreamingRuntime: what the streaming blocks of one model share.

It owns the expert store, the hot cache, the staged slots, the whole-layer
loader and the telemetry, sizes them from :class:`Options` once, and picks a
path per forward. Peak MLX memory during decode is resident weights + hot
cache + staged slots (or window) + KV: all fixed at load, independent of the checkpoint's
size and of generation length, once MLX's buffer cache is capped so freed
transients do not pile up (process-wide, so the caller's choice:
:meth:`mlx_edge0.model.Edge0Model.limit_buffer_cache`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .checkpoint import Edge0Section
from .hot import HotCache, hot_capacity
from .options import Options
from .paths import ExactPath, HotPath, StagedPath, WholeLayerPath
from .prefill import WholeLayerLoader
from .prerouter import load_heads
from .prerouting import Prerouting
from .slots import SlotBuffers
from .staged import StagedSlots
from .store import ExpertStore, pool_scales_dtype
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .streaming import StreamingMoE


class StreamingRuntime:
    """Store, caches, paths and telemetry of one loaded model."""

    def __init__(self, checkpoint_dir: Path, section: Edge0Section, options: Options):
        self.options = options
        self.section = section
        self.compute_dtype = options.dtype()
        self.telemetry = Telemetry()
        # Set to a list to record (layer, routed expert ids) of every synced
        # MoE call, e.g. to compare cache policies on a real trace.
        self.routing_trace: Optional[list[tuple[int, list[int]]]] = None
        self.store = ExpertStore(
            checkpoint_dir,
            section,
            options.io_threads,
            self.telemetry,
            bypass_page_cache=options.page_cache == "bypass",
        )
        g = section.experts
        pool_dtype = self.pool_dtype = pool_scales_dtype(g, self.compute_dtype)
        k = section.num_experts_per_tok
        layers = section.moe_layers
        expert_bytes = g.bundle_bytes * g.num_experts * len(layers)
        capacity = hot_capacity(
            options.cache_bytes(expert_bytes), SlotBuffers.row_nbytes(g, pool_dtype), g.num_experts * len(layers)
        )
        self.hot = HotCache(self.store, capacity, pool_dtype, options.hot_policy) if capacity >= k else None
        if options.k and not section.prerouter:
            raise ValueError(
                f"k={options.k} applies to prerouted layers, and this checkpoint has no prerouter "
                f"heads; make them with `edge0 heads init --k {options.k}`"
            )
        # K per MoE layer: the layers the heads predict route with the heads'
        # K (section.consumer_k); an explicit k must match it.
        spec, heads = (
            load_heads(checkpoint_dir, section, options.k or section.consumer_k) if section.prerouter else (None, {})
        )
        self.k_of = {layer: k for layer in layers}
        if spec is not None:
            self.k_of.update({c: spec.k for c in spec.consumers})
        consumer_of = dict(zip(spec.owners, spec.consumers)) if spec and options.prerouter else {}
        if consumer_of and mx.default_device() == mx.cpu:
            for head in heads.values():  # otherwise they stay unread until a forward uses them
                head.hold_transposed()
        # Staged buffers: per layer (the staged path, and the prerouted layers
        # without a window), or a window the prerouted layers take in turn.
        window = min(options.staged_window, len(consumer_of))
        staged_layers = layers if options.staged else ([] if window else sorted(consumer_of.values()))
        # A layer never routes to more experts than it has: more slots would stay empty.
        self.staged = {
            layer: StagedSlots(
                self.store, layer, min(options.staged_slots or self.k_of[layer], g.num_experts), pool_dtype
            )
            for layer in staged_layers
        }
        self.staged_window = [
            StagedSlots(self.store, -1, min(options.staged_slots or spec.k, g.num_experts), pool_dtype)
            for _ in range(window)
        ]
        self.loader = WholeLayerLoader(self.store, layers, pool_dtype, drop_pages=options.page_cache == "drop-prefill")
        self.exact = ExactPath(self)
        self.decode_fallback = HotPath(self) if self.hot else self.exact
        self.decode = StagedPath(self) if options.staged else self.decode_fallback
        self.whole_layer = WholeLayerPath(self)
        self.first_layer = layers[0]
        self.heads = heads
        self.prerouting = Prerouting(self, self.heads, consumer_of) if consumer_of else None
        # Set inside ``training_forward``: the whole-sequence training forward
        # (mlx_edge0.train.student) that routes and computes every MoE call.
        self.training_path = None

    def attach(self, blocks: dict[int, "StreamingMoE"]) -> None:
        """Give the prerouter the blocks whose routing math it applies."""
        if self.prerouting is not None:
            self.prerouting.blocks = dict(blocks)

    @contextmanager
    def training_forward(self, path) -> Iterator:
        """Hand every MoE call of the forwards run inside to ``path``
        (``path.routed_experts(block, x)``) instead of the serving paths."""
        self.training_path = path
        try:
            yield path
        finally:
            self.training_path = None

    def routed_experts(self, block: "StreamingMoE", x: mx.array):
        """Route one MoE call and compute its experts: (inds, scores, [B, L, K, D])."""
        if self.training_path is not None:
            return self.training_path.routed_experts(block, x)
        layer = block.layer
        path = self.path_for(layer, x)
        planned = self.prerouting.take(layer) if self.prerouting else None
        if planned is not None:
            y = self.prerouting.experts(layer, x, planned)
            inds, scores = planned.inds, planned.scores
        else:
            inds, scores = block.route(block.router_logits(x))
            if self.prerouting is not None:
                inds, scores = self.prerouting.mix(layer, inds, scores)
            y = path.experts(layer, x, inds)
        if self.prerouting is not None:
            self.prerouting.observe(layer, x, inds)
        return inds, scores, y

    def path_for(self, layer: int, x: mx.array):
        """The path for this forward (x: [B, L, D]); opens a telemetry step at
        the first MoE layer and starts any read that can begin before routing."""
        batch, length = x.shape[0], x.shape[1]
        if layer == self.first_layer:
            self.telemetry.begin_step(batch * length)
            if length == 1:
                self.loader.clear()
            if self.prerouting is not None:
                self.prerouting.begin_forward(length, x)
        path = self._choose(batch, length)
        path.begin(layer)
        return path

    def _choose(self, batch: int, length: int):
        if length == 1:
            return self.decode
        mode = self.options.prefill
        if mode == "exact":
            return self.exact
        if mode == "whole-layer":
            return self.whole_layer
        if mode == "auto" and batch * length * self.section.num_experts_per_tok >= self.section.experts.num_experts:
            return self.whole_layer
        return self.decode_fallback

    def resident_bytes(self) -> dict[str, int]:
        return {
            "hot": self.hot.nbytes if self.hot else 0,
            "staged": sum(s.nbytes for s in [*self.staged.values(), *self.staged_window]),
            "exact": self.exact.scratch.nbytes if self.exact.scratch else 0,
            "prerouter_heads": sum(v.nbytes for h in self.heads.values() for _, v in tree_flatten(h.parameters()))
            if self.prerouting is not None
            else 0,
        }

    def stats(self) -> dict:
        """Summed and last-step counters, resident bytes per tier, peak memory."""
        return {
            **self.telemetry.summed().as_dict(),
            "last_step": self.telemetry.last_step.as_dict(),
            "resident_bytes": self.resident_bytes(),
            "peak_memory": mx.get_peak_memory(),
            "decode_path": self.decode.name,
            "prerouter": self.prerouting is not None,
        }

    def close(self) -> None:
        self.loader.clear()
        self.store.close()
