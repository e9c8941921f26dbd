"""StreamingRuntime: what the streaming blocks of one model share, and the
expert source they ask.

It owns the expert store, the hot cache, the staging buffers, the whole-layer
loader, the paths and the telemetry, sizes them from :class:`Options` once,
and answers the blocks' three questions (:class:`mlx_edge0.streaming.ExpertSource`):
is this call's routing planned (:meth:`begin`), what routes the rest
(:meth:`mix`), and the experts for a routing (:meth:`experts`), on the path
it picks per forward. It never calls into a block: the prerouter gets each
consumer's routing math as a callable (:meth:`attach`).

Peak MLX memory during decode is resident weights + hot cache + staging
buffers (or window) + KV: all bounded at load, independent of the checkpoint's
size and of generation length, once MLX's buffer cache is capped so freed
transients do not pile up (process-wide, so the caller's choice:
:meth:`mlx_edge0.model.Edge0Model.limit_buffer_cache`). An "auto" window is
the one tier that grows after load (:meth:`StreamingRuntime.adapt_window`),
and the hot cache's budget is sized against its largest size.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from .checkpoint import RESIDENT_FILE, Edge0Section
from .hot import HotCache, hot_capacity, kept_fits, permanent_fits, planned_fits
from .memory import available_memory
from .options import MIN_STAGED_WINDOW, Options
from .parallel import ExpertShard
from .paths import ExactPath, HotPath, NextLayerRouting, StagedPath, WholeLayerPath
from .prefill import WholeLayerLoader
from .popularity import load_profile, prior_counts
from .prerouter_heads import load_heads
from .prerouting import Plan, Prerouting, Route, grown_window
from .slots import SlotBuffers
from .staging import StagingBuffer
from .store import ExpertStore, pool_scales_dtype
from .streaming import ExpertSource
from .telemetry import Stats, Telemetry


class StreamingRuntime:
    """Store, caches, paths and telemetry of one loaded model: its expert source."""

    def __init__(
        self,
        checkpoint_dir: Path,
        section: Edge0Section,
        options: Options,
        *,
        layers: Optional[Sequence[int]] = None,
        shard: Optional[ExpertShard] = None,
        memory_sharers: int = 1,
    ):
        """
        Args:
            layers: the MoE layers this process runs (default all; a pipeline
                stage's share): only their files are opened, only heads
                whose owner and consumer are both among them are used.
            shard: this rank's share of the experts (expert parallel).
            memory_sharers: processes of this model on this machine (ranks
                of a group on one host), which split the "auto" cache budget.
        """
        # Taken before this runtime holds anything: the heads and staging buffers are
        # allocated before the hot cache is sized, and the "auto" budget counts them
        # as committed; measured after, they would be counted twice.
        available = available_memory() if options.cache_gib == "auto" else None
        self.options = options
        self.section = section
        self.shard = shard
        self.memory_sharers = memory_sharers
        self.compute_dtype = options.dtype()
        self.telemetry = Telemetry()
        layers = tuple(section.moe_layers if layers is None else layers)
        owned = None if shard is None else shard.owned
        self.store = ExpertStore(
            checkpoint_dir,
            section,
            options.io_threads,
            self.telemetry,
            bypass_page_cache=options.page_cache == "bypass",
            layers=layers,
            experts=owned,
        )
        g = section.experts
        widened = self.compute_dtype if options.rows_widened() else None
        pool_dtype = self.pool_dtype = pool_scales_dtype(g, widened)
        k = section.num_experts_per_tok
        self.experts_per_layer = g.num_experts if shard is None else len(owned)
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
        # This process's heads: those whose owner and consumer it runs.
        local_pairs = {o: c for o, c in zip(spec.owners, spec.consumers) if o in layers and c in layers} if spec else {}
        heads = {o: h for o, h in heads.items() if o in local_pairs}
        self.consumer_of = consumer_of = local_pairs if options.prerouter else {}
        if consumer_of and mx.default_device() == mx.cpu:
            for head in heads.values():  # otherwise they stay unread until a forward uses them
                head.hold_transposed()
        # Staging buffers: per layer (the staged path, and the prerouted layers
        # without a window where the hot cache cannot take their fills), or a
        # window the prerouted layers take in turn; an "auto" window starts at
        # MIN_STAGED_WINDOW buffers and may grow to one per prerouted layer
        # (``window_limit``).
        auto = options.staged_window == "auto"
        self.window_limit = len(consumer_of) if auto else min(options.staged_window, len(consumer_of))
        window = min(MIN_STAGED_WINDOW, self.window_limit) if auto else self.window_limit
        # Without a window the prerouted layers' fills are the hot cache's (each
        # expert held once) where it has room to pin a step's plans; else each
        # prerouted layer gets a staging buffer, made once the cache is sized.
        cache_fills = bool(consumer_of) and not window and not options.staged
        self.staging = {layer: self._staging_buffer(layer) for layer in (layers if options.staged else [])}
        self.window_slots = min(options.staged_slots or spec.k, g.num_experts) if window else 0
        self.window = [self._window_buffer() for _ in range(window)]
        self.loader = WholeLayerLoader(
            self.store, layers, pool_dtype, drop_pages=options.page_cache == "drop-prefill", experts=owned
        )
        # The hot cache last: an "auto" budget with the page cache bypassed takes
        # what is left once everything else this process will hold is counted.
        self.heads = heads
        row_bytes = SlotBuffers.row_nbytes(g, pool_dtype)
        resident = (
            (checkpoint_dir / RESIDENT_FILE).stat().st_size  # resident weights, loaded after this
            + self.heads_nbytes()
            + self.experts_per_layer * row_bytes  # a prompt's whole-layer buffer
        )
        total_experts = self.experts_per_layer * len(layers)
        # With the prerouter on, a MoE layer no owner predicts (the first) routes with its gate
        # and the compute waits for its misses: its experts are read into the hot cache once,
        # at load. They stay for good where the cache holds every expert (``permanent_fits``);
        # elsewhere until the cache first has to evict (``add_held``), and a use of theirs then
        # outranks a prerouted layer's (``add_waited``).
        predicted = set(consumer_of.values())
        unpredicted = [layer for layer in layers if layer not in predicted] if consumer_of else []
        rows = len(unpredicted) * self.experts_per_layer

        def sized(capacity: int) -> tuple[bool, bool]:
            permanent = capacity >= k and permanent_fits(capacity, total_experts)
            return permanent, capacity >= k and not permanent and kept_fits(rows, capacity)

        def capacity_left() -> int:
            # every expert as the cache holds it (its rows' scales in the pool's dtype)
            committed = resident + self.staged_nbytes(largest=True)
            budget = options.cache_bytes(row_bytes * total_experts, memory_sharers, committed, available)
            return hot_capacity(budget, row_bytes, total_experts)

        capacity = capacity_left()
        planned = sum(self.k_of[c] for c in consumer_of.values())  # a step's planned bundles, one sequence
        kept = rows if any(sized(capacity)) else 0
        self.cache_fills = cache_fills and capacity >= k and planned_fits(planned, capacity, kept)
        if cache_fills and not self.cache_fills:
            self.staging.update({c: self._staging_buffer(c) for c in sorted(consumer_of.values())})
            capacity = capacity_left()
        self.hot = HotCache(self.store, capacity, pool_dtype, options.hot_policy) if capacity >= k else None
        permanent, held = sized(capacity)
        self.permanent_layers = unpredicted if permanent else []
        self.held_layers = unpredicted if held else []
        experts = range(g.num_experts) if owned is None else [int(e) for e in owned]
        for layer in self.permanent_layers:
            self.hot.add_permanent(layer, experts)
        for layer in self.held_layers:
            self.hot.add_held(layer, experts)
        if self.hot is not None and not permanent:
            for layer in unpredicted:
                self.hot.add_waited(layer, experts)
        profile = load_profile(checkpoint_dir, section) if self.hot is not None and options.popularity_prior else None
        if profile is not None:
            self.hot.add_prior(prior_counts(profile, self.k_of, experts))
        dtype, tel = self.compute_dtype, self.telemetry
        self.exact = ExactPath(self.store, tel, dtype, pool_dtype, max(self.k_of.values()))
        self.decode_fallback = HotPath(self.hot, self.exact, tel, dtype) if self.hot else self.exact
        self.decode = (
            StagedPath(self.staging, self.decode_fallback, self.hot, tel, dtype)
            if options.staged
            else self.decode_fallback
        )
        self.whole_layer = WholeLayerPath(self.loader, tel, dtype, self.hot)
        self.first_layer = layers[0]
        self.layers = layers
        # The hot path's lookahead guesses with the next layer's gate: not where that
        # layer routes by the prerouter's prediction; and in one process (a rank reads
        # only its experts).
        hot_path = isinstance(self.decode_fallback, HotPath)
        self.lookahead = options.lookahead and hot_path and not consumer_of and shard is None
        self.prerouting: Optional[Prerouting] = None  # made by ``attach``
        # Set inside ``training_forward``: the expert source of the
        # whole-sequence training forward (mlx_edge0.train.student).
        self.training_source: Optional[ExpertSource] = None

    def attach(self, routes: dict[int, Route], gates: dict[int, Callable[[mx.array], mx.array]]) -> None:
        """Give the runtime each MoE layer's routing math and router (layer ->
        the block's ``route``, ``router_logits``): with the prerouter on, this
        makes it; with ``lookahead``, the hot path's guess of the next layer."""
        if self.lookahead:
            self.decode_fallback.lookahead = NextLayerRouting(self.layers, gates, routes)
        if self.consumer_of:
            self.prerouting = Prerouting(
                self.heads,
                self.consumer_of,
                routes,
                buffers=self.staging,
                window=self.window,
                hot=self.hot,
                telemetry=self.telemetry,
                compute_dtype=self.compute_dtype,
                num_experts=self.section.experts.num_experts,
                fallback=self.decode_fallback.from_union if self.cache_fills else None,
                **({} if self.shard is None else {"local": self.shard.local}),
            )

    @contextmanager
    def training_forward(self, source: ExpertSource) -> Iterator:
        """Hand every MoE call of the forwards run inside to ``source``
        instead of the serving paths."""
        self.training_source = source
        try:
            yield source
        finally:
            self.training_source = None

    # ------------------------------------------------ the expert source

    def begin(self, layer: int, x: mx.array) -> Optional[Plan]:
        """Open one MoE call (x: [B, L, D]): at the first MoE layer, open a
        telemetry step and turn the last step's predictions into plans; start
        any read that can begin before routing. Returns this layer's plan
        (prerouted decode) or None: the block routes with its gate."""
        if self.training_source is not None:
            return self.training_source.begin(layer, x)
        batch, length = x.shape[0], x.shape[1]
        if layer == self.first_layer:
            closed = self.telemetry.begin_step(batch * length)
            if closed is not None:
                self.adapt_window(closed)
            if length == 1:
                self.loader.clear()
            if self.hot is not None:
                self.hot.open_forward()
            if self.prerouting is not None:
                self.prerouting.begin_forward(length, x)
        self.path(batch, length).begin(layer)
        return self.prerouting.take(layer) if self.prerouting is not None else None

    def mix(
        self, layer: int, x: mx.array, logits: mx.array, inds: mx.array, scores: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The routing of a call without a plan, from its gate's (``logits``,
        ``inds``, ``scores``): predicted positions take the prediction."""
        if self.training_source is not None:
            return self.training_source.mix(layer, x, logits, inds, scores)
        if self.prerouting is None:
            return inds, scores
        return self.prerouting.mix(layer, inds, scores)

    def experts(self, layer: int, x: mx.array, inds: mx.array, plan: Optional[Plan]) -> mx.array:
        """The routed experts' outputs ``[B, L, K, D]`` for routing ``inds``."""
        if self.training_source is not None:
            return self.training_source.experts(layer, x, inds, plan)
        compute = (
            partial(self.prerouting.experts, plan=plan)
            if plan is not None
            else self.path(x.shape[0], x.shape[1]).experts
        )
        if self.shard is None:
            y = compute(layer, x, inds)
        else:  # this rank's (token, slot) pairs, then every rank's in one all_sum
            pairs = self.shard.pairs(inds)
            y_pairs = compute(layer, *self.shard.inputs(x, pairs))
            y = self.shard.combine(y_pairs, pairs, self.compute_dtype or x.dtype, x.shape[-1])
        if self.prerouting is not None:
            self.prerouting.observe(layer, x, inds)
        return y

    # ------------------------------------------------------------------

    def path(self, batch: int, length: int):
        """The path of a forward of ``batch`` x ``length`` tokens."""
        if length == 1:
            return self.decode
        mode = self.options.prefill
        if mode == "exact":
            return self.exact
        if mode == "whole-layer":
            return self.whole_layer
        # An expert-parallel rank gets about 1/N of the pairs for 1/N of the
        # experts: the same ratio, so the same rule.
        if mode == "auto" and batch * length * self.section.num_experts_per_tok >= self.section.experts.num_experts:
            return self.whole_layer
        return self.decode_fallback

    def adapt_window(self, step: Stats) -> int:
        """After ``step`` (a closed step's counters), grow an "auto" window by
        the buffers :func:`~mlx_edge0.prerouting.grown_window` asks for, from
        the prerouted layers' exposed wait and the step's wall time. Called
        when a step opens, before its fills are planned (or by a caller
        between forwards); other windows never change. Returns the window's
        depth."""
        if self.options.staged_window == "auto" and self.prerouting is not None:
            depth = grown_window(len(self.window), step.prerouted_wait_s, step.step_s, self.window_limit)
            while len(self.window) < depth:  # the prerouter holds this same list
                self.prerouting.add_window_buffer(self._window_buffer())
        return len(self.window)

    def _staging_buffer(self, layer: int) -> StagingBuffer:
        # A layer never routes to more experts than it has: more slots would stay empty.
        slots = min(self.options.staged_slots or self.k_of[layer], self.section.experts.num_experts)
        return StagingBuffer(self.store, layer, slots, self.pool_dtype)

    def _window_buffer(self) -> StagingBuffer:
        return StagingBuffer(self.store, -1, self.window_slots, self.pool_dtype)

    def heads_nbytes(self) -> int:
        """Bytes of the heads the prerouter uses; none with it off, where they are never read."""
        if not self.consumer_of:
            return 0
        return sum(v.nbytes for h in self.heads.values() for _, v in tree_flatten(h.parameters()))

    def staged_nbytes(self, *, largest: bool = False) -> int:
        """Bytes the staging buffers and the window hold; ``largest``: with an
        "auto" window grown to its limit (what the hot cache's budget leaves
        room for)."""
        spare = self.window_limit - len(self.window) if largest else 0
        row_bytes = SlotBuffers.row_nbytes(self.store.geometry, self.pool_dtype)
        return sum(b.nbytes for b in [*self.staging.values(), *self.window]) + spare * self.window_slots * row_bytes

    def resident_bytes(self) -> dict[str, int]:
        return {
            "hot": self.hot.nbytes if self.hot else 0,
            "staged": self.staged_nbytes(),
            "exact": self.exact.scratch.nbytes if self.exact.scratch else 0,
            "prerouter_heads": self.heads_nbytes(),
        }

    def stats(self) -> dict:
        """Summed and last-step counters, resident bytes per tier, peak
        memory, the staged window's depth (buffers now; 0: none)."""
        return {
            **self.telemetry.summed().as_dict(),
            "last_step": self.telemetry.last_step.as_dict(),
            "resident_bytes": self.resident_bytes(),
            "peak_memory": mx.get_peak_memory(),
            "decode_path": self.decode.name,
            "prerouter": self.prerouting is not None,
            "lookahead": self.lookahead,
            "staged_window": len(self.window),
        }

    def close(self) -> None:
        self.loader.clear()
        self.store.close()
