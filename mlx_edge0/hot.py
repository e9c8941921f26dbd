"""The hot cache: recently/frequently used expert bundles of all MoE layers
in one byte budget, computed from in place.

All MoE layers share one geometry, so the cache is a single
:class:`SlotBuffers` whose rows hold ``(layer, expert)`` bundles; a routed
expert that is resident is gathered straight from its row (no copy), a miss is
read from disk into a victim row first. A checkpoint's routing profile
(``edge0 profile``) seeds the policy's counts (:meth:`HotCache.add_prior`).

Victims are the policy's (:mod:`mlx_edge0.cache_policy`: LFU with aging by
default, or LRU), among bundles no call needs kept; among the lowest ranked,
those of a layer that has routed in this forward go first (``plan_fill``'s
settled bundles: not wanted again before the next forward). Permanent bundles (:meth:`HotCache.add_permanent`:
with the prerouter, the layers no owner predicts, where the cache holds every expert) are never a
victim; held ones (:meth:`HotCache.add_held`: those layers in a smaller cache) are not
a victim until the cache first has to evict, then the policy ranks them as any other, a use
of theirs worth more than a prerouted layer's (:meth:`HotCache.add_waited`). A prompt
read whole leaves its most-routed experts here (:meth:`HotCache.copy_prompt_experts`),
copied from the rows it read, so the decode that follows starts from them.
A prerouted decode step's layers compute from the rows too: when the step
opens, each planned layer's experts are placed (:meth:`HotCache.start_planned`:
hits where they are, misses read into free rows or victims in the
background) and pinned, out of every victim choice, until that layer's call
computes from them (:meth:`HotCache.finish_planned`); so each expert is held
once, and a hit costs no copy.
With ``lookahead`` the hot path reads the next layer's likely experts in
ahead of its call (:meth:`HotCache.start_prefetch`), one at a time, surest
first; when that layer routes, the reads not started are dropped and what
they displaced is resident again (:meth:`HotCache.settle_prefetch`). Rows
still being written are never a victim nor copied from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AbstractSet, Callable, Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

from .cache_policy import POLICIES, WAITED_MISS_COST, plan_fill
from .slots import SlotBuffers
from .store import ExpertStore, ReadBatch

Key = tuple[int, int]  # (layer, expert)
KEPT_SHARE = 2  # permanent and held bundles together take at most 1/2 of the rows (kept_fits)
PINNED_SHARE = 2  # a step's planned bundles take at most 1/2 of the other rows (planned_fits)


def permanent_fits(capacity: int, total_experts: int) -> bool:
    """Whether bundles can be permanent in a cache of ``capacity`` rows
    without displacing anything: only where the cache holds every expert.
    Anywhere else held (:meth:`HotCache.add_held`) costs the same while the
    cache has room and, once it must evict, lets the policy give the rows
    the decode never routes to the other layers, whose misses are read again
    where reads bind (BENCHMARKS.md, "The first MoE layer held at every
    share")."""
    return capacity >= total_experts


def kept_fits(rows: int, capacity: int) -> bool:
    """Whether ``rows`` bundles kept out of the victim choice (permanent or
    held) leave a cache of ``capacity`` rows enough to route the other layers
    through: at most ``1 / KEPT_SHARE`` of it."""
    return rows <= capacity // KEPT_SHARE


def planned_fits(rows: int, capacity: int, kept: int) -> bool:
    """Whether a decode step's planned bundles, ``rows`` of them, pinned until
    their layers compute, leave a cache of ``capacity`` rows, ``kept`` of them
    permanent or held, enough to route the other layers through: at most
    ``1 / PINNED_SHARE`` of the rest."""
    return rows <= (capacity - kept) // PINNED_SHARE


def hot_capacity(budget_bytes: int, row_bytes: int, total_experts: int) -> int:
    """Rows a byte budget buys: never more than there are expert bundles to
    hold, so a generous budget on a small checkpoint allocates the experts'
    size, not the budget."""
    return min(budget_bytes // row_bytes, total_experts)


class HotCache:
    """Expert bundles across layers within ``capacity`` rows (one byte budget)."""

    def __init__(self, store: ExpertStore, capacity: int, scales_dtype: Optional[mx.Dtype], policy: str = "lfu"):
        self.store = store
        self.capacity = capacity
        self.buffers = SlotBuffers(store.geometry, capacity, scales_dtype)
        self.row_of: dict[Key, int] = {}
        self.free = list(range(capacity))
        self.policy = POLICIES[policy](capacity)
        self.permanent: set[Key] = set()
        self.held: set[Key] = set()  # out of the victim choice until the cache first evicts
        self.waited: set[Key] = set()  # their misses are waited on (add_waited)
        self.ahead: dict[Key, Guess] = {}  # bundles read ahead whose reads have not landed
        self.read_ahead: set[Key] = set()  # read ahead and landed, for a call still to come
        self.pinned: set[Key] = set()  # planned for a call of this step (start_planned)
        self.routed: set[int] = set()  # layers that have routed in this forward: their other bundles are settled
        self.prior: dict[Key, float] = {}  # the routing profile's counts the policy started from (add_prior)

    @property
    def nbytes(self) -> int:
        return self.buffers.nbytes

    def _unevictable(self) -> set[Key]:
        """Permanent, held and pinned bundles, and those whose prefetch reads may still be writing."""
        if not (self.held or self.ahead or self.pinned):
            return self.permanent  # no copy per decode call
        return self.permanent | self.held | self.pinned | self.ahead.keys()

    def open_forward(self) -> None:
        """A forward opens: the rows stop keeping computations two forwards old
        (:meth:`SlotBuffers.open_forward`), and no layer has routed in it yet."""
        self.buffers.open_forward()
        self.routed = set()

    def _settled(self, key: Key) -> bool:
        """Whether ``key`` cannot be wanted again in this forward: its layer
        has routed, to other experts (a victim to prefer, ``plan_fill``)."""
        return key[0] in self.routed

    def _release_held(self, arriving: int) -> None:
        """Hand the held bundles to the policy once ``arriving`` new bundles
        need more rows than are free: from the first eviction on they are
        ranked as every other bundle (a victim only if the policy says so)."""
        if self.held and arriving > len(self.free):
            self.store.telemetry.current.held_released += len(self.held)
            self.held = set()

    def _plan(
        self, keys: list[Key], unevictable: AbstractSet[Key], settled: Optional[Callable[[Key], bool]] = None
    ) -> tuple[dict[Key, int], list[Key]]:
        """:func:`plan_fill` over this cache's rows, its host time counted
        (``planning_s``): every victim choice of a call or a read ahead."""
        started = time.perf_counter()
        planned = plan_fill(keys, self.row_of, self.free, self.policy, unevictable, settled)
        self.store.telemetry.current.planning_s += time.perf_counter() - started
        return planned

    def _make_room(self, layer: int, keys: list[Key]) -> dict[Key, int]:
        """Rows for the keys of ``keys`` (a routed set of ``layer``) that are
        not resident: free rows, then victims, settled ones first; the
        victims are forgotten at once."""
        if self.held:
            self._release_held(sum(k not in self.row_of for k in dict.fromkeys(keys)))
        self.routed.add(layer)
        placed, evicted = self._plan(keys, self._unevictable(), self._settled)
        for k in evicted:
            del self.row_of[k]
            self.policy.forget(k)
        self.free = self.free[len(placed) - len(evicted) :]
        return placed

    def add_prior(self, counts: Mapping[Key, float]) -> None:
        """Count a routing profile's uses (:func:`mlx_edge0.popularity.prior_counts`)
        as seen before the first call, so victims are the experts the profile
        found least popular until the calls' own uses outweigh it (LFU).
        Kept in :attr:`prior`, so a replay of the decode starts from them too."""
        self.policy.add_prior(counts)
        for k, c in counts.items():
            self.prior[k] = self.prior.get(k, 0.0) + c

    def admit(self, layer: int, used: Sequence[int], read: Sequence[tuple[int, int]], source: SlotBuffers) -> None:
        """A staging fill of ``layer`` used experts ``used`` and read ``read``
        ((slot, expert) pairs of ``source``) from disk: count the use, and keep
        copies of what was read, so a later fill that wants them copies instead
        of reading. A prerouted layer's experts then compete for the budget as
        every other layer's do (its fills bypass :meth:`fetch`)."""
        slot_of = {int(e): s for s, e in read}
        keys = [(layer, e) for e in slot_of if (layer, e) not in self.row_of]
        if keys and len(keys) <= self.capacity:
            placed = self._make_room(layer, keys)
            for (_, e), row in placed.items():
                self.buffers.copy_row(source, slot_of[e], row)
            self.row_of.update(placed)
        self.policy.touch([(layer, int(e)) for e in used])

    def copy_prompt_experts(
        self, layer: int, routed: Sequence[int], source: SlotBuffers, row_of: Mapping[int, int]
    ) -> int:
        """A prompt chunk read ``layer`` whole into ``source`` (expert -> row
        ``row_of``) and routed ``routed`` (every routing, repeats included):
        count the uses (ties in recency go to the most used), then copy the
        layer's experts the policy now ranks above what rows hold into free
        rows or those rows, best first. A decode after a long prompt then
        starts from the prompt's experts, not from an empty cache, and each
        copy is a memcpy, not a read.
        Returns the bundles copied."""
        ids, counts = np.unique(np.asarray(routed), return_counts=True)
        order = np.lexsort((ids, counts))  # fewest uses first: the most used are the most recent
        uses = {(layer, int(ids[i])): int(counts[i]) for i in order}
        self.policy.add_uses(uses)
        wanted = [k for k in uses if k not in self.row_of and k[1] in row_of]
        wanted = sorted(wanted, key=self.policy.priority, reverse=True)[: self.capacity]
        placed = dict(zip(wanted, self.free))
        self.free = self.free[len(placed) :]
        rest = wanted[len(placed) :]
        self._release_held(len(rest))  # the free rows are spent: from here on the cache evicts
        unevictable = self._unevictable()
        candidates = [k for k in self.row_of if k not in unevictable] if rest else []
        for k, victim in zip(rest, self.policy.victims(candidates, len(rest))):
            if self.policy.priority(victim) >= self.policy.priority(k):
                break  # victims only rank higher from here on
            placed[k] = self.row_of.pop(victim)
            self.policy.forget(victim)
        for (_, e), row in placed.items():
            self.buffers.copy_row(source, row_of[e], row)
        self.row_of.update(placed)
        self.store.telemetry.current.prompt_copied += len(placed)
        return len(placed)

    def add_permanent(self, layer: int, experts: Sequence[int]) -> None:
        """Read ``experts`` of ``layer`` into rows now and never evict them: for
        a layer whose routing nobody predicts, so its decode reads would be
        waited on. Call at load, before any step (the reads count in no step).

        Raises:
            ValueError: they would take more than half the rows (too few left
                to route the other layers through).
        """
        self.permanent.update(self._read_kept(layer, experts))

    def add_held(self, layer: int, experts: Sequence[int]) -> None:
        """Read ``experts`` of ``layer`` into rows now and keep them out of the
        victim choice until the cache first has to evict (a miss, a prompt's
        copy or a read ahead finds no free row); from then on the policy ranks
        them as every other bundle. For a layer no owner predicts in a cache
        that does not hold every expert (``permanent_fits``): while the cache
        has room it costs the other layers nothing. Call at load.

        Raises:
            ValueError: they would take more than half the rows.
        """
        self.held.update(self._read_kept(layer, experts))

    def add_waited(self, layer: int, experts: Sequence[int]) -> None:
        """Have the policy rank ``experts`` of ``layer`` as worth
        :data:`~mlx_edge0.cache_policy.WAITED_MISS_COST` uses per use: a layer
        no owner predicts, whose misses the compute waits for, where a
        prerouted layer's are read behind the compute. Reads nothing."""
        keys = {(layer, int(e)) for e in experts}
        self.policy.set_cost(keys, WAITED_MISS_COST)
        self.waited.update(keys)

    def _read_kept(self, layer: int, experts: Sequence[int]) -> set[Key]:
        keys = {(layer, int(e)) for e in experts}
        if not kept_fits(len(self.permanent | self.held | keys), self.capacity):
            raise ValueError(f"keeping {len(keys)} experts of layer {layer} leaves too few of {self.capacity} rows")
        self.fetch(layer, experts)
        return keys

    def row(self, layer: int, expert: int) -> Optional[int]:
        """The row to copy ``expert`` of ``layer`` from, or None: not resident, or
        still being read ahead (its bytes are not all there yet)."""
        if (layer, expert) in self.ahead:
            return None
        return self.row_of.get((layer, expert))

    def fetch(self, layer: int, ids: Sequence[int]) -> Optional[np.ndarray]:
        """Make experts ``ids`` of ``layer`` resident (reading misses now) and
        return their rows, or None when the set does not fit the cache."""
        pending = self.start_fetch(layer, ids)
        if pending is None:
            return None
        self.finish_fetch(pending)
        return pending.rows

    def start_fetch(self, layer: int, ids: Sequence[int]) -> Optional["PendingFetch"]:
        """Rows for experts ``ids`` of ``layer``, the misses' reads started
        and not waited for (:meth:`finish_fetch` waits), so the caller can
        compute from the hits while they land; None when the set does not fit
        the cache, or beside the bundles this step's planned calls pin.
        Nothing else may use the cache until :meth:`finish_fetch`."""
        if len(ids) > self.capacity:
            return None
        keys = [(layer, int(e)) for e in ids]
        if self.pinned and len(keys) > self.capacity - len(self._unevictable().difference(keys)):
            return None
        stats = self.store.telemetry.current
        placed = self._make_room(layer, keys)
        read_ahead = len(self.read_ahead.intersection(keys))
        self.read_ahead = {k for k in self.read_ahead if k[0] != layer}  # this was the call they were for
        stats.hot_hits += len(keys) - len(placed) - read_ahead
        stats.lookahead_hits += read_ahead
        stats.hot_misses += len(placed)
        reads = None
        if placed:
            misses = list(placed)
            try:
                reads = self.store.submit(
                    layer, [e for _, e in misses], [placed[k] for k in misses], self.buffers, urgent=True
                )
            except BaseException:
                self.free.extend(placed.values())
                raise
        rows = np.array([placed[k] if k in placed else self.row_of[k] for k in keys], dtype=np.int64)
        return PendingFetch(keys, placed, reads, rows)

    def finish_fetch(self, pending: "PendingFetch") -> None:
        """Wait for :meth:`start_fetch`'s reads; then its experts are resident."""
        if pending.reads is not None:
            try:
                pending.reads.wait()
            except BaseException:
                self.free.extend(pending.placed.values())  # rows hold garbage now: free, not resident
                raise
        self.row_of.update(pending.placed)
        self.policy.touch(pending.keys)

    def start_planned(self, layer: int, ids: Sequence[int]) -> Optional["PendingFetch"]:
        """Rows for experts ``ids`` of a prerouted ``layer`` whose call is
        planned this step (its routing decided when the step opens), the
        misses' reads started in the background, behind any urgent read. The
        bundles stay pinned, out of every victim choice, until
        :meth:`finish_planned` (the call computes from them) or
        :meth:`drop_planned`; the step's other calls place their misses around
        them. None when the step's pinned bundles would not leave the other
        calls enough rows (:func:`planned_fits`): the call then reads on demand."""
        keys = [(layer, int(e)) for e in ids]
        if not planned_fits(len(self.pinned) + len(keys), self.capacity, len(self.permanent | self.held)):
            return None
        stats = self.store.telemetry.current
        placed = self._make_room(layer, keys)
        stats.hot_hits += len(keys) - len(placed)
        stats.hot_misses += len(placed)
        misses = list(placed)
        try:
            reads = self.store.submit(layer, [e for _, e in misses], [placed[k] for k in misses], self.buffers)
        except BaseException:
            self.free.extend(placed.values())
            raise
        self.pinned.update(keys)
        rows = np.array([placed[k] if k in placed else self.row_of[k] for k in keys], dtype=np.int64)
        return PendingFetch(keys, placed, reads, rows)

    def finish_planned(self, pending: "PendingFetch") -> None:
        """After the reads of :meth:`start_planned` landed (the caller waited
        on ``pending.reads``): its experts are resident and unpinned, their
        use counted. The call's computation from the rows must be recorded
        next (:meth:`SlotBuffers.compute` with their ``rows``) so that no
        write changes them before it is evaluated."""
        self.pinned.difference_update(pending.keys)
        self.finish_fetch(pending)

    def drop_planned(self, pending: "PendingFetch") -> None:
        """A planned call that will not compute (its forward raised, or a read
        failed): once no read writes its rows any more, the misses' rows are
        free (what they hold is not known to be whole) and its bundles unpinned."""
        pending.reads.settle()
        self.pinned.difference_update(pending.keys)
        self.free.extend(pending.placed.values())

    def start_prefetch(self, layer: int, ids: Sequence[int], keep: AbstractSet[Key] = frozenset()) -> int:
        """Queue reads of experts ``ids`` of ``layer`` (surest first) that are
        not resident, for a call of ``layer`` that has not routed yet: one at
        a time (:meth:`ExpertStore.queue_reads`), into free rows or victims
        other than ``keep`` (the calling layer's routed set, whose compute may
        still read its rows), as many as fit. They count as resident at once,
        their rows out of every victim choice and copy until
        :meth:`settle_prefetch` finds them landed; a victim is forgotten only
        once a read has written its row (a dropped read gives the row back to
        it). Returns the bundles queued."""
        keys = list(dict.fromkeys((layer, int(e)) for e in ids if (layer, int(e)) not in self.row_of))
        self._release_held(len(keys))
        unevictable = self._unevictable() | keep
        spare = len(self.free) + sum(k not in unevictable for k in self.row_of)
        keys = keys[:spare]
        if not keys:
            return 0
        placed, evicted = self._plan(keys, unevictable)
        free_rows = len(placed) - len(evicted)
        self.free = self.free[free_rows:]
        displaced = [None] * free_rows + evicted
        for k in evicted:
            del self.row_of[k]
        try:
            reads = self.store.queue_reads(layer, [e for _, e in keys], [placed[k] for k in keys], self.buffers)
        except BaseException:
            for k, victim in zip(keys, displaced):
                self._give_back(placed[k], victim)
            raise
        for k, victim, batch in zip(keys, displaced, reads):
            self.ahead[k] = Guess(placed[k], victim, batch)
        self.row_of.update(placed)
        self.store.telemetry.current.lookahead_read += len(keys)
        return len(keys)

    def settle_prefetch(self, layer: int, ids: Sequence[int]) -> None:
        """Before a call of ``layer`` that routed ``ids``: drop every read ahead
        not started yet (what it displaced is resident again; a routed one is
        a miss of this call), wait for those this call routes, and make every
        landed one resident. A read still running for an expert this call
        does not route keeps its row out of use until it lands (a later call
        finds it). A failed read is raised once all are settled, its bundle
        not resident."""
        if not self.ahead:
            return
        for key, guess in list(self.ahead.items()):
            if guess.reads.cancel():
                del self.ahead[key], self.row_of[key]
                self._give_back(guess.row, guess.displaced)
        routed = {(layer, int(e)) for e in ids}
        error = None
        for key, guess in list(self.ahead.items()):
            if key not in routed and not guess.reads.done():
                continue
            del self.ahead[key]
            if guess.displaced is not None and guess.displaced not in self.row_of:
                self.policy.forget(guess.displaced)  # its row was written, whatever the read's outcome
            try:
                guess.reads.wait()
            except BaseException as e:
                del self.row_of[key]
                self.free.append(guess.row)  # the row holds garbage: free, not resident
                error = error or e
                continue
            if key[0] == layer:
                self.read_ahead.add(key)
        if error is not None:
            raise error

    def _give_back(self, row: int, displaced: Optional[Key]) -> None:
        """A row a prefetch took and never wrote: to the bundle it displaced
        (its bytes are still there) unless that was read again since, else free."""
        if displaced is not None and displaced not in self.row_of:
            self.row_of[displaced] = row
        else:
            self.free.append(row)


@dataclass
class Guess:
    """A bundle read ahead by :meth:`HotCache.start_prefetch`.

    Attributes:
        row: the row it is read into.
        displaced: the bundle that row held (None: a free row).
        reads: its read, queued or in flight.
    """

    row: int
    displaced: Optional[Key]
    reads: ReadBatch


@dataclass
class PendingFetch:
    """A routed set's rows while its misses are read (:meth:`HotCache.start_fetch`).

    Attributes:
        keys: the routed ``(layer, expert)`` bundles, in the order asked for.
        placed: the misses and the rows they are read into.
        reads: those reads in flight (None: every bundle was resident).
        rows: each key's row; a miss's holds its bytes once ``reads`` landed.
    """

    keys: list[Key]
    placed: dict[Key, int]
    reads: Optional[ReadBatch]
    rows: np.ndarray

    @property
    def missed(self) -> np.ndarray:
        """Whether each key is a miss."""
        return np.array([k in self.placed for k in self.keys], dtype=bool)
