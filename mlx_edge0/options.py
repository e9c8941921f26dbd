"""The one options record: every runtime knob, typed and validated once.

Options reach a model either from :func:`mlx_edge0.load` (keyword arguments) or,
when stock ``mlx_lm.generate`` / ``mlx_lm.server`` load a checkpoint, from their
defaults. Each field's metadata holds what a command line needs to offer it
(help text, choices, a parser for values that are not plain ``int``/``bool``);
:mod:`mlx_edge0.flags` turns the fields into ``edge0 generate`` / ``edge0 serve``
flags, so this module stays free of click.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Optional, Union

import mlx.core as mx

from .memory import available_memory

RUNTIME_KEY = "edge0_runtime"
COMPUTE_DTYPES = ("auto", "native", "float32", "bfloat16", "float16")
PREFILL_PATHS = ("auto", "whole-layer", "exact")
HOT_POLICIES = ("lfu", "lru")
PAGE_CACHE_POLICIES = ("keep", "drop-prefill", "bypass")
ROW_SCALES = ("auto", "checkpoint", "compute")
PARALLEL_MODES = ("expert", "pipeline")
GIB = 1 << 30
# A staged window needs one buffer per prerouted layer the host may build
# ahead of compute (2) plus the one being filled; an "auto" window starts here.
MIN_STAGED_WINDOW = 3
# "auto" hot cache: this share of available memory, at most this share of the experts.
AUTO_CACHE_MEMORY_SHARE = 0.10
AUTO_CACHE_EXPERT_SHARE = 0.25
# With page_cache="bypass" the hot cache is the only copy of an expert in memory,
# so "auto" takes the room the page cache would have had: this share of what is
# available once the process's other memory is counted (the rest: KV, activations,
# MLX's buffer cache, the interpreter), up to every expert.
AUTO_BYPASS_MEMORY_SHARE = 0.85


def auto_or(number: Callable[[str], Union[int, float]], fix: str) -> Callable[[str], Union[int, float, str]]:
    """A parser of an option's text that takes "auto" or a ``number``
    (``int``, ``float``); its range is checked by :class:`Options`.

    The parser raises ``ValueError`` for anything else, with ``fix`` (what
    to write instead) in the message.
    """

    def parse(value: str) -> Union[int, float, str]:
        if value == "auto":
            return value
        try:
            return number(value)
        except ValueError:
            raise ValueError(f"{value!r}: use {fix}") from None

    return parse


parse_cache_gib = auto_or(float, "'auto' or a number of GiB")
parse_staged_window = auto_or(int, f"0, an integer >= {MIN_STAGED_WINDOW} or 'auto'")


def _option(
    default: Any,
    help: Optional[str] = None,
    choices: tuple[str, ...] = (),
    parse: Optional[Callable[[str], Any]] = None,
) -> Any:
    """A field of :class:`Options` with its command-line metadata (read by
    :mod:`mlx_edge0.flags`): ``help``, ``choices`` (a closed set of strings),
    ``parse`` (text -> value, raising ``ValueError`` with the fix)."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse})


@dataclass(frozen=True)
class Options:
    """Runtime options of a loaded edge0 model.

    Attributes:
        compute_dtype: "auto" computes in float32 on the CPU (MLX's CPU
            quantized kernels are scalar and 16-bit math is emulated: fp32 is
            faster and more accurate) and in the checkpoint's dtype on a GPU;
            "native" never casts; or an explicit float dtype.
        row_scales: the dtype expert rows (hot cache, staging, scratch) hold
            scales and biases in: "checkpoint" keeps the disk's, so a row is
            the bundle's size and a budget holds the most experts, and each
            call casts the rows it uses to the compute dtype; "compute"
            widens them once, when a row is filled (on the CPU, float32 scales
            of bf16 checkpoints: 11% larger rows, no cast per call); "auto":
            "checkpoint" with ``page_cache="bypass"``, where the rows are the
            only copy of an expert in memory and each row saves reads, else
            "compute", where the page cache backs a miss and the cast would
            cost compute for little. The same on Metal, where the compute
            dtype is the checkpoint's.
        io_threads: threads that read expert bytes with ``preadv``.
        cache_gib: hot-cache budget in GiB, or "auto" (10% of available
            memory, at most a quarter of the experts: room is left for the
            page cache and KV; with ``page_cache="bypass"``, which keeps no
            page cache, 85% of what available memory leaves once resident
            weights, heads, staging and the prompt buffer are counted, up to
            every expert).
            Available memory is capped by the process's cgroup limit
            (``memory.available_memory``). 0 disables the hot cache. Either way the
            cache never holds more than all the experts, so a budget above
            their size allocates their size.
        hot_policy: "lfu" (frequency with aging) or "lru".
        popularity_prior: seed the hot cache's counts with the checkpoint's
            routing profile (``popularity.safetensors``, written by ``edge0
            profile``) when it has one, so a short decode's cache keeps the
            experts popular on that text rather than learning it (weighted
            as :data:`mlx_edge0.popularity.PRIOR_TOKENS` tokens' routings).
        lookahead: for a prompt chunk on the hot path (one too short to read
            whole layers), while a layer computes, read into the hot cache
            the experts the next MoE layer's own router picks from this
            layer's input (most tokens route alike in adjacent layers), so
            the next layer's misses are on their way before it routes: one
            at a time, surest first, behind the chunk's own; those not
            started when that layer routes are dropped. The routing never
            changes: the outputs are bit-identical. Decode steps never look
            ahead (there the wrong guesses' reads cost more than the overlap
            buys). With the prerouter off (its layers route by prediction),
            in one process.
        staged: decode through per-layer staged slots (one buffer of K rows each).
        staged_slots: slots per staged buffer (0 = the layer's K, one routed
            set); at most the number of experts.
        staged_window: staged buffers of the prerouted layers. 0 = none
            where the hot cache can hold a step's plans (their fills are the
            cache's rows: each expert held once), else one per prerouted
            layer; either way every fill starts when the step opens (the most
            read-ahead; staging memory: prerouted layers x K rows). N >= 3 = N
            buffers used in turn, layer order: a layer's fill starts when
            the host reaches the prerouted layer N-2 before it, so reads run
            about N-2 layers ahead of compute in N x K rows. For when memory,
            not read time, is short. "auto" = start at 3 buffers and double them
            after each decode step whose prerouted layers waited for reads
            more than a set share of the step
            (:data:`mlx_edge0.prerouting.WINDOW_WAIT_SHARE`), up to one per
            prerouted layer; it never shrinks. The hot cache's "auto" budget
            leaves room for the largest window.
        prefill: prompt-chunk path: "auto" (whole layer when the chunk routes
            to about every expert, else the decode fallback), "whole-layer",
            or "exact".
        page_cache: "keep" leaves every read in the OS page cache (the OS
            reclaims it under pressure; decode misses after a prompt then hit
            it); "drop-prefill" evicts whole-layer prefill reads once they are
            in our buffers, so a prompt does not pull the whole checkpoint
            into the page cache (decode reads stay cached); "bypass" reads
            every expert around the page cache (O_DIRECT / F_NOCACHE): for a
            checkpoint that does not fit in memory, where the kernel's work
            of caching reads that will be evicted unread competes with
            compute for the CPU.
        prerouter: route prerouted layers with the heads' predictions when
            the checkpoint has heads (decode, per sequence); False = the
            on-demand paths (the A/B baseline).
        k: experts per token on the prerouted (consumer) layers, e.g. 8 -> 4.
            0 = the K the checkpoint's heads were made for (the native K
            without heads). Heads must match it (``edge0 heads init --k K``):
            swapping K is swapping files.
        lora: apply the checkpoint's recovery LoRA adapters
            (``adapters.safetensors``) when it has them, unmerged; False =
            the int4 base alone.
        parallel: how the ranks of an ``mx.distributed`` group (``load(...,
            group=...)``, ``mlx.launch``) share the model: "expert" (each
            rank reads and computes its share of every layer's experts) or
            "pipeline" (each keeps its share of the layers; the families
            whose mlx-lm model can pipeline). One process ignores it.
    """

    compute_dtype: str = _option(
        "auto", "float32 on CPU by default; the checkpoint's dtype on Metal.", choices=COMPUTE_DTYPES
    )
    row_scales: str = _option(
        "auto",
        "Expert rows hold scales in the checkpoint's dtype (most experts per GiB; cast per call) "
        "or the compute dtype (widened once); 'auto': the checkpoint's with page_cache=bypass.",
        choices=ROW_SCALES,
    )
    io_threads: int = _option(4)
    cache_gib: Union[float, str] = _option(
        "auto", "Hot expert cache budget in GiB ('auto': from available memory; 0: off).", parse=parse_cache_gib
    )
    hot_policy: str = _option("lfu", choices=HOT_POLICIES)
    popularity_prior: bool = _option(
        True, "Seed the hot cache's counts with the checkpoint's routing profile (edge0 profile), if it has one."
    )
    lookahead: bool = _option(
        True, "Prompt chunks on the hot path read the next layer's likely experts while a layer computes."
    )
    staged: bool = _option(False, "Decode through per-layer staged slots.")
    staged_slots: int = _option(0, "Slots per staged buffer (0 = K).")
    staged_window: Union[int, str] = _option(
        0,
        "Staged buffers the prerouted layers take in turn (0 = the hot cache's rows, or one per layer; "
        "N >= 3: N x K rows, reads about N-2 layers ahead; "
        "'auto': from 3, one more after each step whose reads stalled compute).",
        parse=parse_staged_window,
    )
    prefill: str = _option("auto", "Prompt-chunk path.", choices=PREFILL_PATHS)
    page_cache: str = _option("keep", "What expert reads leave in the OS page cache.", choices=PAGE_CACHE_POLICIES)
    prerouter: bool = _option(True, "Route with the prerouter heads' predictions (when the checkpoint has heads).")
    k: int = _option(0, "Experts per token on prerouted layers (0 = the checkpoint's K).")
    lora: bool = _option(True, "Apply the checkpoint's recovery LoRA adapters (when it has them), unmerged.")
    parallel: str = _option(
        "expert",
        "How the ranks of an mlx.launch group share the model: each reads and computes its share of every "
        "layer's experts, or keeps its share of the layers (families mlx-lm can pipeline).",
        choices=PARALLEL_MODES,
    )

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if self.row_scales not in ROW_SCALES:
            raise ValueError(f"row_scales must be one of {', '.join(ROW_SCALES)}, got {self.row_scales!r}")
        if not isinstance(self.io_threads, int) or not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be an integer in 1..64, got {self.io_threads!r}")
        if self.cache_gib != "auto" and not (isinstance(self.cache_gib, (int, float)) and self.cache_gib >= 0):
            raise ValueError(f"cache_gib must be 'auto' or a number >= 0, got {self.cache_gib!r}")
        if self.hot_policy not in HOT_POLICIES:
            raise ValueError(f"hot_policy must be one of {', '.join(HOT_POLICIES)}, got {self.hot_policy!r}")
        if not isinstance(self.staged_slots, int) or self.staged_slots < 0:
            raise ValueError(f"staged_slots must be an integer >= 0, got {self.staged_slots!r}")
        if self.staged_window != "auto" and not (
            isinstance(self.staged_window, int) and (self.staged_window == 0 or self.staged_window >= MIN_STAGED_WINDOW)
        ):
            raise ValueError(
                f"staged_window must be 0 (a buffer per prerouted layer), an integer >= {MIN_STAGED_WINDOW} "
                f"(that many buffers) or 'auto' (from {MIN_STAGED_WINDOW}, grown while reads stall compute), "
                f"got {self.staged_window!r}"
            )
        if not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"k must be an integer >= 0 (0 = the checkpoint's K), got {self.k!r}")
        if self.page_cache not in PAGE_CACHE_POLICIES:
            raise ValueError(f"page_cache must be one of {', '.join(PAGE_CACHE_POLICIES)}, got {self.page_cache!r}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {self.parallel!r}")
        if self.prefill not in PREFILL_PATHS:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_PATHS)}, got {self.prefill!r}")

    def cache_bytes(
        self, expert_bytes: int, sharers: int = 1, committed: int = 0, available: Optional[int] = None
    ) -> int:
        """The hot-cache budget for a model whose experts total ``expert_bytes``
        as the cache holds them (a rank's share of them), when ``sharers``
        processes of one model share this machine's memory (ranks of a group
        on one host): "auto" splits the memory term between them.
        ``committed``: bytes the process will hold besides the cache (resident
        weights, heads, staging, the prompt's buffer), which a bypassing "auto"
        budget leaves room for. ``available``: the memory available before any
        of ``committed`` was allocated (default: measured now), so that none
        is counted twice."""
        if self.cache_gib == "auto":
            memory = (available_memory() if available is None else available) / max(1, sharers)
            if self.page_cache == "bypass":
                return int(min(AUTO_BYPASS_MEMORY_SHARE * max(0, memory - committed), expert_bytes))
            return int(min(AUTO_CACHE_MEMORY_SHARE * memory, AUTO_CACHE_EXPERT_SHARE * expert_bytes))
        return int(self.cache_gib * GIB)

    def rows_widened(self) -> bool:
        """Whether expert rows hold scales in the compute dtype (``row_scales``)."""
        if self.row_scales == "auto":
            return self.page_cache != "bypass"
        return self.row_scales == "compute"

    def dtype(self) -> Optional[mx.Dtype]:
        """The dtype floating weights are cast to, or None to keep them."""
        name = self.compute_dtype
        if name == "auto":
            return mx.float32 if mx.default_device() == mx.cpu else None
        if name == "native":
            return None
        return getattr(mx, name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[dict[str, Any]]) -> "Options":
        d = d or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown edge0 option(s): {', '.join(unknown)}")
        return cls(**d)
