"""Several processes, one model: expert parallel and pipeline parallel over
``mx.distributed`` (launched by ``mlx.launch``; ring over TCP, JACCL over
Thunderbolt, MPI).

Expert parallel (:class:`ExpertShard`): every rank holds the resident weights
(attention, norms, routers, shared experts, prerouter heads) and routes every
token itself; expert ``e`` of every MoE layer belongs to rank ``e mod N``. A
rank reads, caches, stages and computes only the (token, slot) pairs routed to
its own experts, writes their outputs into the slots of a zero ``[B, L, K, D]``
tensor, and one ``all_sum`` per MoE call combines the ranks' tensors. Every
slot is written on exactly one rank and the others add zeros to it, so the
sum *is* the single-process tensor (``v + 0 == v``), and the block mixes it
with the scores as one process does: tokens and logits are those of one
process, to the bit wherever one pair's product does not depend on which
other pairs are multiplied with it (it does not on the CPU; tests check).
Summing the mixed ``[B, L, D]`` instead would move K times fewer bytes but
round the ranks' partial mixtures apart; at decode the collective costs its
latency, not its bytes (BENCHMARKS.md, "Expert parallel").

The embedding and the LM head are split by vocabulary (:class:`VocabShard`,
:func:`split_vocabulary`): rank ``r`` holds only the contiguous rows
``[floor(r V / N), floor((r + 1) V / N))`` of each (quantized or not; a tied
head is the split embedding's ``as_linear``), read from the resident file
alone when the loader hands the weights over (the whole tables are never
evaluated), else copied out of them and the whole arrays dropped. A lookup
takes the ids in this rank's rows, zeros for the others, and one ``all_sum``
gives every rank the embeddings (``v + 0 == v`` again); the head computes
its rows' logits and one ``all_gather`` (each rank's padded to the widest
range, then trimmed) assembles the vocabulary. A row's logit does not depend
on which other rows are multiplied with it (on the CPU; tests check), so
these too are one process's numbers.

Pipeline parallel (:func:`pipeline_stage`): mlx-lm's own ``pipeline(group)``
of the families whose model has one; each rank keeps its layers' resident
weights and opens only those layers' expert files. A prerouter head whose
consumer layer is on another rank is dropped: that layer routes with its
gate, as the first MoE layer always does.

Every rank must load the same checkpoint: :func:`check_same_checkpoint`
compares digests across the group before anything is loaded.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import gather_last_axis

from .checkpoint import CONFIG_FILE, RESIDENT_FILE, Edge0Section
from .options import PARALLEL_MODES
from .tensorfile import RowReader, read_header

# The key under which mlx-edge0's loaders hand a :class:`Parallel` to the
# model through mlx-lm's ``model_config`` (in process; never written to disk).
PARALLEL_KEY = "edge0_parallel"


@dataclass(frozen=True)
class Parallel:
    """How this process shares a model with the other ranks of ``group``."""

    group: Any  # mx.distributed.Group
    mode: str = "expert"
    ranks_on_host: int = 1  # ranks of the group on this machine, which share its memory

    def __post_init__(self):
        if self.mode not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class Pairs:
    """The (token, slot) pairs of one MoE call routed to this rank's experts."""

    tokens: np.ndarray  # [P] flat token index (b * L + l)
    positions: np.ndarray  # [P] flat (token, slot) index into B * L * K
    experts: np.ndarray  # [P] global expert id
    shape: tuple[int, int, int]  # B, L, K

    @property
    def count(self) -> int:
        return len(self.positions)


class ExpertShard:
    """This rank's share of every MoE layer's experts (see the module docstring)."""

    def __init__(self, group: Any, num_experts: int):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.num_experts = num_experts
        self.owner = np.arange(num_experts) % self.size  # rank of each expert
        self.owned = np.flatnonzero(self.owner == self.rank)

    def local(self, ids: np.ndarray) -> np.ndarray:
        """The experts of ``ids`` this rank owns."""
        ids = np.asarray(ids)
        return ids[self.owner[ids] == self.rank]

    def pairs(self, inds: mx.array) -> Pairs:
        """This rank's pairs of routing ``inds`` ``[B, L, K]`` (a host sync)."""
        host = np.array(inds)
        flat = host.reshape(-1)
        positions = np.flatnonzero(self.owner[flat] == self.rank)
        return Pairs(positions // host.shape[-1], positions, flat[positions], host.shape)

    @staticmethod
    def inputs(x: mx.array, pairs: Pairs) -> tuple[mx.array, mx.array]:
        """The pairs as a call of their own: activations ``[P, D]``, experts ``[P, 1]``."""
        x_pairs = x.reshape(-1, x.shape[-1])[mx.array(pairs.tokens.astype(np.int32))]
        return x_pairs, mx.array(pairs.experts.astype(np.uint32)[:, None])

    def combine(self, y_pairs: mx.array, pairs: Pairs, dtype: mx.Dtype, width: int) -> mx.array:
        """Every rank's pair outputs ``[P, 1, D]`` in their slots of ``[B, L, K, D]``
        (a rank with no pair in this call still joins the ``all_sum``)."""
        B, L, K = pairs.shape
        full = mx.zeros((B * L * K, width), dtype)
        if pairs.count:
            full[mx.array(pairs.positions.astype(np.int32))] = y_pairs[:, 0].astype(dtype)
        return mx.distributed.all_sum(full, group=self.group).reshape(B, L, K, width)


class VocabShard:
    """This rank's rows of the vocabulary (see the module docstring): rank
    ``r`` holds ``[bounds[r], bounds[r + 1])``, near-equal contiguous ranges."""

    def __init__(self, group: Any, vocab: int):
        self.group = group
        size, rank = group.size(), group.rank()
        self.vocab = vocab
        self.bounds = [r * vocab // size for r in range(size + 1)]
        self.start, self.end = self.bounds[rank], self.bounds[rank + 1]
        counts = np.diff(self.bounds)
        self.width = int(counts.max())  # every rank's logits are padded to this for the all_gather
        # the real logits among the gathered [size * width] (None: all of them)
        self.columns = None
        if self.width * size != vocab:
            keep = np.concatenate([r * self.width + np.arange(n) for r, n in enumerate(counts)])
            self.columns = mx.array(keep.astype(np.int32))

    def keep_rows(self, module: nn.Module, read: Optional[RowReader] = None) -> None:
        """Replace every parameter of ``module`` (an embedding or LM head, all
        indexed by the vocabulary on axis 0) with this rank's rows, so that the
        whole arrays are no longer referenced from it. ``read`` (parameter
        name, first row, end row -> those rows, or None) reads them from the
        file without the rest: evaluating a slice of a lazily loaded array
        loads all of it, and mlx-lm's loader holds that until it returns."""

        def rows(name: str, v: mx.array) -> mx.array:
            got = read(name, self.start, self.end) if read is not None else None
            if got is not None and got.shape == (self.end - self.start, *v.shape[1:]) and got.dtype == v.dtype:
                return got
            return mx.contiguous(v[self.start : self.end])  # a slice shares its source's buffer

        module.update(tree_unflatten([(k, rows(k, v)) for k, v in tree_flatten(module.parameters())]))

    def embed(self, embedding: nn.Module, ids: mx.array) -> mx.array:
        """Every id's embedding ``[..., D]``, ``embedding`` holding this rank's rows."""
        local = ids.astype(mx.int32) - self.start
        mine = (local >= 0) & (local < self.end - self.start)
        h = embedding(mx.where(mine, local, 0))
        return mx.distributed.all_sum(mx.where(mine[..., None], h, 0), group=self.group)

    def gather(self, logits: mx.array) -> mx.array:
        """This rank's logits ``[..., end - start]`` -> every rank's ``[..., vocab]``."""
        pad = self.width - logits.shape[-1]
        if pad:
            logits = mx.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, pad)])
        full = gather_last_axis(logits, self.group)  # [..., size * width]
        return full if self.columns is None else mx.take(full, self.columns, axis=-1)


class VocabRows(nn.Module):
    """A vocabulary-indexed module (embedding or LM head) reduced to this
    rank's rows, ``rows``, that answers as the whole one."""

    def __init__(self, module: nn.Module, shard: VocabShard, read: Optional[RowReader] = None):
        super().__init__()
        shard.keep_rows(module, read)
        self.rows = module
        self.shard = shard


class VocabEmbedding(VocabRows):
    """The input embedding: lookups, and ``as_linear`` (the tied LM head)."""

    def __call__(self, ids: mx.array) -> mx.array:
        return self.shard.embed(self.rows, ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.shard.gather(self.rows.as_linear(x))


class VocabHead(VocabRows):
    """The LM head: the logits of the whole vocabulary."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.shard.gather(self.rows(x))


def module_at(model: nn.Module, path: str) -> Optional[nn.Module]:
    """The module at dotted ``path`` of ``model``, or None when it has none there."""
    for name in path.split("."):
        model = getattr(model, name, None)
    return model


def split_vocabulary(
    model: nn.Module, embedding_path: str, head_path: str, group: Any, read: Optional[RowReader] = None
) -> VocabShard:
    """Swap the embedding at ``embedding_path`` and the LM head at
    ``head_path`` (none there: tied to the embedding) for their
    :class:`VocabEmbedding` and :class:`VocabHead` over ``group``;
    ``read`` gets parameter paths of ``model`` (see :meth:`VocabShard.keep_rows`).

    Raises:
        ValueError: ``model`` has no embedding at ``embedding_path``, or its
            head has another vocabulary.
    """
    embedding, head = module_at(model, embedding_path), module_at(model, head_path)
    if embedding is None or not callable(getattr(embedding, "as_linear", None)):
        raise ValueError(f"{type(model).__name__} has no input embedding at {embedding_path!r}")
    vocab = embedding.weight.shape[0]
    if head is not None and head.weight.shape[0] != vocab:
        raise ValueError(f"{head_path} has {head.weight.shape[0]} rows, the embedding {embedding_path} {vocab}")
    shard = VocabShard(group, vocab)

    def under(path: str) -> Optional[RowReader]:
        return None if read is None else (lambda name, start, end: read(f"{path}.{name}", start, end))

    swaps = [(embedding_path, VocabEmbedding(embedding, shard, under(embedding_path)))]
    if head is not None:
        swaps.append((head_path, VocabHead(head, shard, under(head_path))))
    model.update_modules(tree_unflatten(swaps))
    return shard


def pipeline_stage(model: Any) -> Optional[Any]:
    """The module of ``model`` that has mlx-lm's ``pipeline(group)``, or None
    when the installed mlx-lm cannot pipeline this family."""
    for path in ("model", "language_model.model"):
        stage = module_at(model, path)
        if stage is not None and callable(getattr(stage, "pipeline", None)):
            return stage
    return None


def checkpoint_digest(directory: Path, section: Edge0Section) -> bytes:
    """SHA-256 over config.json (which names every file's SHA-256 and the
    conversion's generation id when convert wrote them) and the headers of
    the resident and expert files (which name the tensors, their layout and
    the generation of checkpoints that predate those)."""
    digest = hashlib.sha256((directory / CONFIG_FILE).read_bytes())
    for name in [RESIDENT_FILE, *section.expert_files]:
        header = read_header(directory / name)
        digest.update(name.encode())
        digest.update(repr(sorted((k, v.dtype, v.shape, v.start, v.end) for k, v in header.entries.items())).encode())
        digest.update(repr(sorted(header.metadata.items())).encode())
    return digest.digest()


def check_same_checkpoint(group: Any, directory: Path, section: Edge0Section) -> None:
    """Refuse to start unless every rank of ``group`` loads the same checkpoint.

    Raises:
        ValueError: naming the ranks whose checkpoint differs from rank 0's.
    """
    everyone = gather_bytes(group, checkpoint_digest(directory, section))
    differ = [r for r in range(group.size()) if not np.array_equal(everyone[r], everyone[0])]
    if differ:
        ranks = ", ".join(str(r) for r in differ)
        raise ValueError(
            f"{directory}: rank {group.rank()} of {group.size()}: the checkpoint of rank(s) {ranks} differs from "
            "rank 0's (config.json or a tensor file header); every rank must load the same conversion"
        )


def ranks_on_host(group: Any) -> int:
    """How many ranks of ``group`` (this one included) run on this machine:
    they share its memory, so they split what "auto" budgets take from it."""
    hosts = gather_bytes(group, hashlib.sha256(socket.gethostname().encode()).digest()[:8])
    return int(sum(np.array_equal(host, hosts[group.rank()]) for host in hosts))


def settle(group: Any) -> None:
    """Return once every rank of ``group`` has ended its work in flight. A
    rank that exits while another still runs collectives with it (the step
    generate_step queues after the last token) fails that rank's calls:
    "connection to a peer was lost"."""
    gather_bytes(group, b"\0")


def gather_bytes(group: Any, data: bytes) -> np.ndarray:
    """Every rank's ``data`` (the same length on every rank), one row per rank."""
    # Collectives of different streams must not interleave: let work still in
    # flight end first, on the default stream and on mlx-lm's generation
    # stream, where generate_step leaves the step after its last token running.
    from mlx_lm.generate import generation_stream

    mx.synchronize()
    mx.synchronize(generation_stream)
    mine = mx.array(np.frombuffer(data, np.uint8))
    return np.array(mx.distributed.all_gather(mine, group=group, stream=mx.cpu)).reshape(group.size(), -1)
