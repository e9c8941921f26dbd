"""The routing profile: how often each expert was routed to on some text, so a
hot cache starts knowing which experts are popular instead of learning it.

LFU learns popularity from the uses it has seen, and a short decode ends
before it has seen many, and falls well behind Belady's MIN over a short
decode (BENCHMARKS.md, "A routing profile before the decode"). ``edge0 profile``
runs the model over text the user chooses (or seeded random tokens, for a
synthetic checkpoint) and writes each MoE layer's routing counts to
``popularity.safetensors``; a load seeds the hot cache's policy with them
(:func:`prior_counts`), weighted as :data:`PRIOR_TOKENS` tokens' routings, so
what the decode itself routes soon counts as much.

File: tensor ``counts`` (float32, ``[MoE layers, E]``, routings counted);
metadata: format, version, the MoE layers, tokens counted, each layer's K
(a layer the prerouter heads predict routes at their K, the others at the
checkpoint's; a version 1 file kept one K for all and still loads), the
source of the text, the checkpoint's generation. Saving records its SHA-256 in
``edge0.sha256`` (so ``edge0 info --verify`` covers it). Loading validates
all of it and names the file on any mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

from .atomic import atomic_path, write_json_atomic
from .checkpoint import CONFIG_FILE, CheckpointError, Edge0Section, read_config
from .integrity import GENERATION_KEY, check_generation, record_sha256
from .progress import bar
from .tensorfile import TensorFileError, TensorWriter, read_header, row_reader

PROFILE_FILE = "popularity.safetensors"
PROFILE_FORMAT = "edge0-popularity"
PROFILE_VERSION = 2  # 2: K per MoE layer; 1 (one K for all) is still read
COUNTS = "counts"
# The prior weighs as much as this many tokens' routings. Lighter, LFU learns
# little from it; heavier, it keeps the profile's favourites over what the
# decode routes (replayed on recorded decodes: BENCHMARKS.md, "A routing
# profile before the decode").
PRIOR_TOKENS = 128
PROFILE_CHUNK = 1024  # tokens a forward of ``edge0 profile`` (a prompt chunk: whole layers read once)

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class RoutingProfile:
    """Routings counted per MoE layer and expert over ``tokens`` tokens.

    Attributes:
        layers: the MoE layers, one row of ``counts`` each.
        counts: ``[len(layers), E]`` float32, routings of each expert.
        tokens: tokens the counts were made from.
        k: experts a token was routed to on each MoE layer, one per row
            (None from a version 1 file, which recorded one K for all layers).
        source: what text was run (a file name, or random tokens and their seed).
    """

    layers: tuple[int, ...]
    counts: np.ndarray
    tokens: int
    k: Optional[tuple[int, ...]]
    source: str

    def shares(self) -> np.ndarray:
        """Each expert's share of its layer's routings (a layer with none: zeros)."""
        totals = self.counts.sum(axis=1, keepdims=True)
        return np.divide(self.counts, totals, out=np.zeros_like(self.counts), where=totals > 0)


def profile_of(
    counted: Mapping[int, np.ndarray],
    k_of: Mapping[int, int],
    layers: Sequence[int],
    num_experts: int,
    tokens: int,
    source: str,
) -> RoutingProfile:
    """The profile of per-layer routing counts (``Telemetry.routing_counts``:
    layer -> counts by expert id, possibly shorter than ``num_experts``),
    made with ``k_of`` (layer -> the K it routed with)."""
    counts = np.zeros((len(layers), num_experts), np.float32)
    for row, layer in enumerate(layers):
        c = np.asarray(counted.get(layer, ()), np.float64)[:num_experts]
        counts[row, : len(c)] = c
    return RoutingProfile(tuple(layers), counts, tokens, tuple(k_of[layer] for layer in layers), source)


def describe_k(layers: Sequence[int], k: Optional[Sequence[int]]) -> str:
    """``K=4``, or ``K=4 (8 on layer 0)`` where some MoE layers routed at another K."""
    if k is None:
        return "K of each layer not recorded (a version 1 file)"
    k = list(k)
    common = max(set(k), key=k.count)
    others = ", ".join(f"{x} on layer {layer}" for layer, x in zip(layers, k) if x != common)
    return f"K={common}" + (f" ({others})" if others else "")


def measure_profile(
    model, tokens: Sequence[int], source: str, chunk: int = PROFILE_CHUNK, show_progress: bool = True
) -> RoutingProfile:
    """Run ``tokens`` through an edge0 ``model`` as one prompt, ``chunk``
    tokens a forward (the KV cache kept), and count every MoE layer's
    routings (``Telemetry.routing_counts``). Each token is counted once, as
    the prompt routes it, whichever path reads its experts."""
    from mlx_lm.models.cache import make_prompt_cache

    if not tokens:
        raise ValueError("no tokens to profile")
    runtime, section = model.edge0_runtime, model.edge0_section
    telemetry, layers = runtime.telemetry, len(section.moe_layers)
    chunks = range(0, len(tokens), chunk)
    cache = make_prompt_cache(model)
    # Counted by MoE layer: one forward of a chunk is most of an hour for a
    # large model on a CPU, and a bar by chunks would sit still through it.
    with bar(len(chunks) * layers, "edge0 profile", unit="layer", show=show_progress) as progress:
        telemetry.routing_counts, telemetry.counted_layer = {}, lambda _: progress.update()
        try:
            for done, start in enumerate(chunks, 1):
                mx.eval(model(mx.array(tokens[start : start + chunk])[None], cache=cache))
                progress.n = done * layers  # a path that counts a layer twice cannot run it past the end
                progress.refresh()
            counted = telemetry.routing_counts
        finally:
            telemetry.routing_counts, telemetry.counted_layer = None, None
    return profile_of(counted, runtime.k_of, section.moe_layers, section.experts.num_experts, len(tokens), source)


def prior_counts(
    profile: RoutingProfile,
    k_of: Mapping[int, int],
    experts: Optional[Sequence[int]] = None,
    tokens: int = PRIOR_TOKENS,
) -> dict[Key, float]:
    """What the hot cache's policy starts from: for each MoE layer of ``k_of``
    (layer -> the K it routes with here), ``tokens`` tokens' worth of
    routings split by the profile's shares (experts it never saw left out).
    ``experts``: this process's experts (expert parallel), default all."""
    shares = profile.shares()
    row_of = {layer: i for i, layer in enumerate(profile.layers)}
    ids = range(profile.counts.shape[1]) if experts is None else experts
    counts = {}
    for layer, k in k_of.items():
        if layer in row_of:
            for e in ids:
                if shares[row_of[layer], e] > 0:
                    counts[(layer, int(e))] = float(shares[row_of[layer], e]) * k * tokens
    return counts


def save_profile(checkpoint: Path, profile: RoutingProfile) -> Path:
    """Write popularity.safetensors atomically, with the checkpoint's
    generation; its checksum joins the others when convert recorded them."""
    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)
    generation = config["edge0"].get(GENERATION_KEY)
    metadata = {
        "format": PROFILE_FORMAT,
        "version": str(PROFILE_VERSION),
        "layers": json.dumps(list(profile.layers)),
        "tokens": str(profile.tokens),
        "k": json.dumps(list(profile.k)),
        "source": profile.source,
        **({GENERATION_KEY: generation} if generation else {}),
    }
    counts = np.ascontiguousarray(profile.counts, np.float32)
    path = checkpoint / PROFILE_FILE
    with atomic_path(path) as tmp, TensorWriter(tmp, [(COUNTS, "F32", counts.shape)], metadata) as writer:
        writer.write(COUNTS, counts)
    if record_sha256(config, PROFILE_FILE, writer.sha256):
        write_json_atomic(checkpoint / CONFIG_FILE, config, indent=2, sort_keys=True)
    return path


def load_profile(checkpoint: Path, section: Edge0Section) -> Optional[RoutingProfile]:
    """The checkpoint's routing profile, or None when it has none.

    Raises:
        CheckpointError: naming popularity.safetensors and what is wrong:
            another conversion's file, another geometry, counts that are
            negative or not finite.
    """
    path = Path(checkpoint) / PROFILE_FILE
    if not path.exists():
        return None

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: {problem}; make it again with `edge0 profile`")

    try:
        header = read_header(path)
        check_generation(path, header.metadata, read_config(checkpoint)["edge0"].get(GENERATION_KEY))
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    meta = header.metadata
    version = meta.get("version")
    if meta.get("format") != PROFILE_FORMAT or version not in ("1", str(PROFILE_VERSION)):
        raise fail(
            f"not an edge0 routing profile of version 1 to {PROFILE_VERSION} "
            f"(format {meta.get('format')!r}, version {version!r})"
        )
    try:
        layers = tuple(int(x) for x in json.loads(meta["layers"]))
        tokens = int(meta["tokens"])
        # Version 1 kept one K (the largest); its counts are the same, so it still seeds the cache.
        k = (int(meta["k"]),) * len(layers) if version == "1" else tuple(int(x) for x in json.loads(meta["k"]))
    except (KeyError, TypeError, ValueError) as e:
        raise fail(f"malformed metadata ({e!r})") from None
    shape = (len(section.moe_layers), section.experts.num_experts)
    if layers != tuple(section.moe_layers):
        raise fail(f"counts are for MoE layers {list(layers)}, the checkpoint's are {list(section.moe_layers)}")
    entry = header.entries.get(COUNTS)
    if entry is None or entry.dtype != "F32" or entry.shape != shape or len(header.entries) != 1:
        found = {n: (e.dtype, list(e.shape)) for n, e in header.entries.items()}
        raise fail(f"expected one F32 tensor {COUNTS!r} of shape {list(shape)}, found {found}")
    try:
        counts = np.array(row_reader(path)(COUNTS, 0, shape[0]))
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise fail("counts must be finite and >= 0")
    if tokens < 0 or len(k) != len(layers) or not all(1 <= x <= shape[1] for x in k):
        raise fail(f"tokens must be >= 0 and k one K in 1..{shape[1]} per MoE layer, got tokens={tokens}, k={list(k)}")
    return RoutingProfile(layers, counts, tokens, None if version == "1" else k, meta.get("source", ""))


def require_profile(checkpoint: Path) -> RoutingProfile:
    """``checkpoint``'s routing profile, read against its own config: where a
    checkpoint is named for its profile (the replay scripts' ``--profile``),
    it must have one.

    Raises:
        CheckpointError: the checkpoint has no profile (named, with how to
            make one), or one :func:`load_profile` refuses.
    """
    checkpoint = Path(checkpoint)
    profile = load_profile(checkpoint, Edge0Section.from_config(read_config(checkpoint), checkpoint / CONFIG_FILE))
    if profile is None:
        raise CheckpointError(f"{checkpoint}: no {PROFILE_FILE} (make it with `edge0 profile`)")
    return profile
