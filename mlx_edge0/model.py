"""Edge0Model: a stock mlx-lm model whose MoE blocks stream their experts.

Each family in ``model_patches`` declares
``class Model(Edge0Model, <stock mlx_lm Model>)``: the instance *is* the stock
model (same class hierarchy, parameter names, caches, ``sanitize``), built by
the stock constructor, after which every MoE block named in the checkpoint's
``edge0`` section is swapped for the family's streaming block. The stock
block's lazily-initialised expert tensors are dropped before they are ever
evaluated, so building the model allocates no expert memory.

Under expert parallel the model also holds only this rank's rows of the
vocabulary (:func:`mlx_edge0.parallel.split_vocabulary`): the embedding and
LM head found at the family's ``vocab_paths`` are split as mlx-lm's loader
hands the weights over (:meth:`Edge0Model.load_weights`), or in
:meth:`Edge0Model.shard`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import __version__ as mlx_lm_version
from mlx_lm.models.cache import KVCache

from .checkpoint import RESIDENT_FILE, CheckpointError, Edge0Section
from .lora import attach, consumer_k, has_adapters, read_adapters
from .options import Options
from .parallel import (
    ExpertShard,
    Parallel,
    VocabShard,
    check_same_checkpoint,
    module_at,
    pipeline_stage,
    ranks_on_host,
    split_vocabulary,
)
from .runtime import StreamingRuntime
from .streaming import StreamingMoE
from .tensorfile import row_reader


LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Edge0Args:
    """What a patched model is built from (returned by ``ModelArgs.from_dict``)."""

    model_type: str
    family: Any
    stock_args: Any
    section: Edge0Section
    options: Options
    checkpoint_dir: Path
    parallel: Optional[Parallel] = None  # this process's share of the model (mx.distributed)


class Edge0Model:
    """Mixin placed before the stock model class; see the module docstring."""

    stock_block: ClassVar[type]
    streaming_block: ClassVar[type[StreamingMoE]]
    # LoRA targets: projection name inside a decoder layer -> kind (see lora.py)
    lora_targets: ClassVar[dict[str, str]] = {}
    # Where the stock model keeps its input embedding and its LM head (nothing
    # there when the config ties the head to the embedding).
    vocab_paths: ClassVar[tuple[str, str]]

    def __init__(self, args: Edge0Args):
        super().__init__(args.stock_args)
        self.edge0_section = args.section
        self.edge0_checkpoint_dir = args.checkpoint_dir
        # The layers this process runs: all, or (pipeline parallel) mlx-lm's
        # stage of them, ``model.layers`` then being that stage's.
        self.edge0_stage = self._pipeline(args) if args.parallel and args.parallel.mode == "pipeline" else None
        first, layers = (self.edge0_stage or (0, 0))[0], self.layers
        stock_moe = [first + i for i, layer in enumerate(layers) if isinstance(layer.mlp, self.stock_block)]
        expected = [i for i in args.section.moe_layers if first <= i < first + len(layers)]
        if expected != stock_moe:
            raise CheckpointError(
                f"{args.checkpoint_dir / 'config.json'}: edge0.moe_layers "
                f"{list(args.section.moe_layers)} do not match the MoE layers "
                f"{stock_moe} of this {args.model_type} config"
            )
        shard = (
            ExpertShard(args.parallel.group, args.section.experts.num_experts)
            if args.parallel and args.parallel.mode == "expert"
            else None
        )
        self.edge0_options = args.options
        self.edge0_vocab: Optional[VocabShard] = None  # this rank's rows of the vocabulary, once split
        self.edge0_runtime = StreamingRuntime(
            args.checkpoint_dir,
            args.section,
            args.options,
            layers=stock_moe if self.edge0_stage else None,
            shard=shard,
            memory_sharers=args.parallel.ranks_on_host if args.parallel else 1,
        )
        for i in stock_moe:
            layers[i - first].mlp = self.streaming_block.from_stock(
                layers[i - first].mlp,
                layer=i,
                source=self.edge0_runtime,
                num_experts_per_tok=self.edge0_runtime.k_of[i],
            )
        self.edge0_runtime.attach(self._routes(), self._gates())
        # Adapters wrap their (still unquantized) targets now; ``sanitize``
        # renames the base tensors under them, and mlx-lm quantizes and loads
        # the whole tree strictly as usual.
        self.edge0_adapters = None
        if args.options.lora and has_adapters(args.checkpoint_dir):
            self.edge0_adapters = read_adapters(args.checkpoint_dir, k=consumer_k(self))
            config = self.edge0_adapters.config
            attach(self, tuple(t for t in config.targets if self._in_stage(t)), config.rank, config.alpha)

    def _blocks(self) -> list[StreamingMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, StreamingMoE)]

    def _routes(self) -> dict:
        return {block.layer: block.route for block in self._blocks()}

    def _gates(self) -> dict:
        return {block.layer: block.router_logits for block in self._blocks()}

    def shard(self, group: Optional[Any] = None) -> None:
        """mlx-lm's tensor-parallel hook, which its ``sharded_load`` calls
        (``mlx_lm.server`` under ``mlx.launch``): for an edge0 model, expert
        parallel over ``group`` (default: the global group). The runtime is
        rebuilt for this rank's share; every rank must call it."""
        group = group or mx.distributed.init()
        if self.edge0_stage is not None or self.edge0_runtime.shard is not None:
            raise ValueError("this model is already shared with other ranks")
        check_same_checkpoint(group, self.edge0_checkpoint_dir, self.edge0_section)
        self.edge0_runtime.close()
        runtime = StreamingRuntime(
            self.edge0_checkpoint_dir,
            self.edge0_section,
            self.edge0_options,
            shard=ExpertShard(group, self.edge0_section.experts.num_experts),
            memory_sharers=ranks_on_host(group),
        )
        for block in self._blocks():
            block.source = runtime
        runtime.attach(self._routes(), self._gates())
        self.edge0_runtime = runtime
        self.edge0_vocab = split_vocabulary(self, *self.vocab_paths, group)

    def load_weights(self, file_or_weights: Any, strict: bool = True) -> "Edge0Model":
        """``nn.Module.load_weights``; then, under expert parallel, the split of
        the vocabulary. mlx-lm's ``load_model`` calls it before it evaluates
        the parameters, so the other ranks' rows are read but never kept."""
        super().load_weights(file_or_weights, strict=strict)
        shard = self.edge0_runtime.shard
        if shard is not None and self.edge0_vocab is None:
            # this rank's rows straight from the file: the whole arrays stay unread
            read = row_reader(self.edge0_checkpoint_dir / RESIDENT_FILE)
            self.edge0_vocab = split_vocabulary(self, *self.vocab_paths, shard.group, read)
        return self

    def vocab_modules(self) -> list[nn.Module]:
        """The input embedding and the LM head (only the embedding when
        tied): whole, or this rank's rows of them."""
        return [m for m in (module_at(self, path) for path in self.vocab_paths) if m is not None]

    def _pipeline(self, args: Edge0Args) -> tuple[int, int]:
        """Keep only this rank's pipeline stage (mlx-lm's ``pipeline``):
        returns its ``[first, end)`` layers.

        Raises:
            ValueError: the installed mlx-lm cannot pipeline this family.
        """
        stage = pipeline_stage(self)
        if stage is None:
            raise ValueError(
                f"{args.checkpoint_dir / 'config.json'}: mlx-lm {mlx_lm_version} has no pipeline parallel for "
                f"model_type {args.model_type!r}; use parallel='expert' (every family has it)"
            )
        stage.pipeline(args.parallel.group)
        return stage.start_idx, stage.end_idx

    def _in_stage(self, name: str) -> bool:
        """Whether a parameter or module path belongs to this process's
        layers (everything outside ``layers.N`` is every stage's)."""
        if self.edge0_stage is None:
            return True
        found = LAYER_NUMBER.search(name)
        return found is None or self.edge0_stage[0] <= int(found.group(1)) < self.edge0_stage[1]

    @property
    def make_cache(self) -> Callable[[], list]:
        """The stock caches, plus (with the prerouter on) one ``ArraysCache``
        of per-sequence prediction state, so batching carries it.

        A property so that, with the prerouter off, a family whose stock
        model has no ``make_cache`` still has none: mlx-lm then builds its
        caches itself and honours ``max_kv_size`` (a rotating KV cache).
        With the prerouter on that option cannot reach us and is ignored.
        """
        stock = getattr(super(), "make_cache", None)
        prerouting = self.edge0_runtime.prerouting
        if prerouting is None:
            if stock is None:
                raise AttributeError("make_cache")
            return stock

        def make_cache() -> list:
            caches = stock() if stock is not None else [KVCache() for _ in self.layers]
            return [*caches, prerouting.make_cache()]

        return make_cache

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, **kwargs) -> mx.array:
        prerouting = self.edge0_runtime.prerouting
        if prerouting is None:
            return super().__call__(inputs, cache=cache, **kwargs)
        state = None
        if cache is not None and len(cache) == len(self.layers) + 1:
            *cache, state = cache
        prerouting.bind(state)
        try:
            out = super().__call__(inputs, cache=cache, **kwargs)
        finally:
            prerouting.bind(None)
        if state is not None and state.lengths is not None:
            state.advance(inputs.shape[1])
        return out

    def sanitize(self, weights: dict) -> dict:
        """Stock sanitize, the adapters' tensors (when loaded), then the
        compute-dtype cast (fp32 on CPU by default)."""
        weights = super().sanitize(weights)
        if self.edge0_adapters is not None:
            weights = self.edge0_adapters.with_weights(weights)
        if self.edge0_stage is not None:  # the other stages' layers are not in this model
            weights = {k: v for k, v in weights.items() if self._in_stage(k)}
        dtype = self.edge0_runtime.compute_dtype
        if dtype is None:
            return weights
        # float32 loses nothing, so everything floating is cast (as
        # ``set_dtype(mx.float32)`` would); narrower casts honour the stock
        # model's cast_predicate (e.g. A_log, expert_bias stay float32).
        keep = None if dtype == mx.float32 else getattr(self, "cast_predicate", None)
        return {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and (keep is None or keep(k)) else v
            for k, v in weights.items()
        }

    def limit_buffer_cache(self) -> int:
        """Cap MLX's buffer cache at one layer's experts (the largest transient
        a forward frees), so freed transients do not pile up; returns the
        previous limit.

        ``mx.set_cache_limit`` holds for every model in the process, so
        loading never calls this: the entry points whose process runs this
        model alone do (``edge0 generate``, ``edge0 serve``, the bench child,
        stock mlx-lm commands through the checkpoint's shim).
        """
        return mx.set_cache_limit(self.edge0_runtime.loader.layer_bytes)

    def stats(self) -> dict:
        """Telemetry since load (or the last reset): summed counters, the last
        step, resident bytes per tier (``vocab``: the embedding and LM head
        this process holds), peak MLX memory."""
        stats = self.edge0_runtime.stats()
        vocab = sum(v.nbytes for m in self.vocab_modules() for _, v in tree_flatten(m.parameters()))
        stats["resident_bytes"]["vocab"] = vocab
        return stats

    def reset_stats(self) -> None:
        """Zero the telemetry and MLX's peak-memory counter (e.g. after warm-up)."""
        self.edge0_runtime.telemetry.reset()
        mx.reset_peak_memory()
