"""Prerouter heads: layer N predicts layer N+1's router logits one token ahead.

A head owned by MoE layer N reads, at token t, layer N's post-attention-norm
output ``h`` (the MoE block's input) and two top-k one-hots of layer N's own
routing (tokens t and t-1), and outputs router logits for the next MoE layer
at token t+1::

    head(h, on_t, on_t-1) = fc2(gelu(fc1(x))) + residual(h) + onehot_residual([on_t, on_t-1])
    x = concat(h, on_t, on_t-1)               # width d_model + 2E

The linear residual is split into its hidden and one-hot parts so the warm
start is exact: ``residual`` is initialised with the next layer's router
weight and ``fc2`` / ``onehot_residual`` with zeros, so an untrained head
returns exactly "the next router applied to the current hidden" (the free
baseline peers use) and training starts there.

Files: ``prerouter.safetensors`` (tensors ``heads.{N}.*``; metadata: format,
version, owners, consumers, K, hidden width, source hash = SHA-256 of the
checkpoint's router tensors, the checkpoint's generation) and
``edge0.prerouter`` in config.json, where saving also records the file's
SHA-256 in ``edge0.sha256`` (when convert recorded checksums). Loading
validates all of it and names the file on any mismatch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .atomic import atomic_path, write_json_atomic
from .checkpoint import CONFIG_FILE, RESIDENT_FILE, CheckpointError, read_config
from .integrity import GENERATION_KEY, check_generation, record_sha256
from .tensorfile import TensorFileError, TensorWriter, dtype_code, read_header, tensors_sha256

PREROUTER_FILE = "prerouter.safetensors"
PREROUTER_FORMAT = "edge0-prerouter"
PREROUTER_VERSION = 1
HIDDEN = 512
HEAD_KEY = re.compile(r"heads\.(\d+)\.(.+)")


class PrerouterHead(nn.Module):
    """One head: ``d_model + 2E`` -> ``hidden`` -> next layer's ``E_next`` logits."""

    def __init__(self, d_model: int, num_experts: int, num_experts_next: int, hidden: int = HIDDEN):
        super().__init__()
        width = d_model + 2 * num_experts
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, num_experts_next)
        self.residual = nn.Linear(d_model, num_experts_next, bias=False)
        self.onehot_residual = nn.Linear(2 * num_experts, num_experts_next, bias=False)

    def __call__(self, h: mx.array, onehot_now: mx.array, onehot_prev: mx.array) -> mx.array:
        onehots = mx.concatenate([onehot_now, onehot_prev], axis=-1)
        x = mx.concatenate([h, onehots], axis=-1)
        return self.fc2(nn.gelu(self.fc1(x))) + self.residual(h) + self.onehot_residual(onehots)

    def hold_transposed(self) -> None:
        """Keep each weight as an ``[in, out]`` buffer viewed as ``[out, in]``.

        ``nn.Linear`` multiplies by ``weight.T``, which is then contiguous:
        MLX's CPU matrix-vector product is faster on it (BENCHMARKS.md,
        "Measurements behind code comments"). Same values,
        same parameter names; an optimizer update stores its result in the
        usual layout again.
        """
        for linear in (self.fc1, self.fc2, self.residual, self.onehot_residual):
            linear.weight = mx.contiguous(linear.weight.T).T
        mx.eval(self.parameters())

    def warm_start(self, next_router: mx.array) -> None:
        """Make the head equal to ``h @ next_router.T`` (see the module docstring)."""
        self.residual.weight = next_router.astype(mx.float32)
        self.fc2.weight = mx.zeros_like(self.fc2.weight)
        self.fc2.bias = mx.zeros_like(self.fc2.bias)
        self.onehot_residual.weight = mx.zeros_like(self.onehot_residual.weight)


def topk_onehot(inds: mx.array, num_experts: int) -> mx.array:
    """[..., K] expert indices -> [..., E] float32 0/1 mask."""
    return (mx.expand_dims(inds, -1) == mx.arange(num_experts)).any(axis=-2).astype(mx.float32)


@dataclass(frozen=True)
class PrerouterSpec:
    """Which layers own heads and which consume them (``edge0.prerouter``)."""

    owners: tuple[int, ...]
    consumers: tuple[int, ...]
    k: int
    hidden: int = HIDDEN
    file: str = PREROUTER_FILE

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "owners": list(self.owners),
            "consumers": list(self.consumers),
            "k": self.k,
            "hidden": self.hidden,
        }

    @classmethod
    def default(cls, moe_layers: tuple[int, ...], k: int) -> "PrerouterSpec":
        """Every MoE layer that has a next MoE layer owns a head for it."""
        return cls(tuple(moe_layers[:-1]), tuple(moe_layers[1:]), k)


def routers_hash(checkpoint: Path) -> str:
    """SHA-256 over the router tensors of ``model.safetensors`` (sorted by
    name; name + bytes): heads are tied to exactly these routers. Stored as
    the heads file's ``source_hash``."""
    path = Path(checkpoint) / RESIDENT_FILE
    return tensors_sha256(path, sorted(n for n in read_header(path).entries if _is_router(n)))


def _is_router(name: str) -> bool:
    return (".mlp.gate." in name) and "shared" not in name


def init_heads(model, spec: Optional[PrerouterSpec] = None, seed: int = 0) -> dict[int, PrerouterHead]:
    """Warm-started heads for a loaded edge0 model (owner layer -> head)."""
    section = model.edge0_section
    spec = spec or PrerouterSpec.default(section.moe_layers, section.num_experts_per_tok)
    if not 0 < spec.k <= section.experts.num_experts:
        raise ValueError(f"K={spec.k} is not in 1..{section.experts.num_experts}")
    mx.random.seed(seed)
    g = section.experts
    heads = {}
    for owner, consumer in zip(spec.owners, spec.consumers):
        head = PrerouterHead(g.hidden_size, g.num_experts, g.num_experts, spec.hidden)
        head.warm_start(model.layers[consumer].mlp.router_weight())
        heads[owner] = head
    mx.eval([h.parameters() for h in heads.values()])
    return heads


def save_heads(checkpoint: Path, heads: dict[int, PrerouterHead], spec: PrerouterSpec) -> Path:
    """Write prerouter.safetensors and the config section, each atomically;
    the file carries the checkpoint's generation, and its checksum joins the
    others (so ``edge0 info --verify`` stays right)."""
    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)
    generation = config["edge0"].get(GENERATION_KEY)
    tensors = {}
    for owner, head in sorted(heads.items()):
        for name, value in tree_flatten(head.parameters()):
            tensors[f"heads.{owner}.{name}"] = value
    metadata = {
        "format": PREROUTER_FORMAT,
        "version": str(PREROUTER_VERSION),
        "owners": json.dumps(list(spec.owners)),
        "consumers": json.dumps(list(spec.consumers)),
        "k": str(spec.k),
        "hidden": str(spec.hidden),
        "source_hash": routers_hash(checkpoint),
        **({GENERATION_KEY: generation} if generation else {}),
    }
    path = checkpoint / spec.file
    entries = [(n, dtype_code(v.dtype), tuple(v.shape)) for n, v in tensors.items()]
    with atomic_path(path) as tmp, TensorWriter(tmp, entries, metadata) as writer:
        for name, value in tensors.items():
            writer.write(name, value)
    config["edge0"]["prerouter"] = spec.to_dict()
    record_sha256(config, spec.file, writer.sha256)
    write_json_atomic(checkpoint / CONFIG_FILE, config, indent=2, sort_keys=True)
    return path


def load_heads(checkpoint: Path, section, k: int = 0) -> tuple[PrerouterSpec, dict[int, PrerouterHead]]:
    """Read and validate the heads named by ``edge0.prerouter`` for routing
    ``k`` experts on the consumer layers (0: the checkpoint's K).

    Raises:
        CheckpointError: naming prerouter.safetensors and the mismatch.
    """
    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)
    raw = config["edge0"].get("prerouter")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{checkpoint / CONFIG_FILE}: no edge0.prerouter section")
    path = checkpoint / raw.get("file", PREROUTER_FILE)

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: {problem}")

    try:
        spec = PrerouterSpec(
            tuple(int(x) for x in raw["owners"]),
            tuple(int(x) for x in raw["consumers"]),
            int(raw["k"]),
            int(raw.get("hidden", HIDDEN)),
            raw.get("file", PREROUTER_FILE),
        )
        header = read_header(path)
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{checkpoint / CONFIG_FILE}: malformed edge0.prerouter ({e})") from None
    meta = header.metadata
    try:
        check_generation(path, meta, config["edge0"].get(GENERATION_KEY), required=False)
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    if meta.get("format") != PREROUTER_FORMAT or meta.get("version") != str(PREROUTER_VERSION):
        raise fail(
            f"not an edge0 prerouter file of version {PREROUTER_VERSION} "
            f"(format {meta.get('format')!r}, version {meta.get('version')!r})"
        )
    layers = section.moe_layers
    for owner, consumer in zip(spec.owners, spec.consumers):
        if owner not in layers or consumer not in layers or layers.index(consumer) != layers.index(owner) + 1:
            raise fail(f"head of layer {owner} -> {consumer} does not link consecutive MoE layers {list(layers)}")
    if len(spec.owners) != len(spec.consumers) or not spec.owners:
        raise fail("owners and consumers must pair up one to one")
    for key, want in (
        ("owners", list(spec.owners)),
        ("consumers", list(spec.consumers)),
        ("k", spec.k),
        ("hidden", spec.hidden),
    ):
        got = json.loads(meta.get(key, "null"))
        if got != want:
            raise fail(f"metadata {key}={got!r} does not match config.json ({want!r})")
    want_k = k or section.num_experts_per_tok
    if spec.k != want_k:
        raise fail(
            f"heads were made for K={spec.k}, but K={want_k} was asked for "
            f"(make matching heads with `edge0 heads init --k {want_k}`)"
        )
    if meta.get("source_hash") != routers_hash(checkpoint):
        raise fail("heads were made for another model (router weights differ: source_hash mismatch)")
    g = section.experts
    heads = {}
    weights = mx.load(str(path))
    strays = [k for k in weights if not (m := HEAD_KEY.fullmatch(k)) or int(m[1]) not in spec.owners]
    if strays:
        raise fail(f"tensors that belong to no head of {list(spec.owners)}: {strays[:3]}")
    for owner in spec.owners:
        head = PrerouterHead(g.hidden_size, g.num_experts, g.num_experts, spec.hidden)
        want = dict(tree_flatten(head.parameters()))
        prefix = f"heads.{owner}."
        got = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        if set(got) != set(want):
            raise fail(f"head {owner} has tensors {sorted(got)}, expected {sorted(want)}")
        for name, value in got.items():
            if value.shape != want[name].shape:
                raise fail(f"heads.{owner}.{name} has shape {list(value.shape)}, expected {list(want[name].shape)}")
        head.load_weights(list(got.items()))
        heads[owner] = head
    return spec, heads
