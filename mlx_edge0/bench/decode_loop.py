"""The bench's decode loop, pipelined as mlx-lm's ``generate_step`` runs it.

``generate_step`` builds and queues step t+1 (``async_eval``) before it reads
step t's token back, from the step after the prompt's last token on, so the
host's work for a step (a prerouted step's fills start when it opens)
overlaps the compute of the one before at every decoded token. The bench
decodes warm-up steps and then timed ones; run the same way throughout, the
first timed step is queued while the last warm-up step computes, as every
later one is, and the pipeline starts in the warm-up, where
``generate_step``'s starts in the prompt's last token.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator


def pipelined_steps(
    first: Any,
    queue_step: Callable[[Any, bool], Any],
    warmup: int,
    timed: int,
    begin_timed: Callable[[], None],
) -> Iterator[tuple[int, Any]]:
    """Yield ``(i, token)`` for ``warmup + timed`` steps, step i's token read
    back (``.item()``) only after step i+1 is queued.

    ``queue_step(prev, is_timed)`` builds and queues the step after token
    ``prev`` (an array that may still be computing) and returns its token
    array; ``begin_timed()`` runs once, right before the first timed step is
    queued, so whatever it snapshots (counters, device bytes) covers every
    timed step's host work and reads, and the warm-up's host work is done
    by then. Steps ``warmup`` onward are the timed ones: a step's time is
    from the read-back of the token before to its own.
    """
    total = warmup + timed
    if total == 0:
        return
    if warmup == 0:
        begin_timed()
    queued = queue_step(first, warmup == 0)
    for i in range(total):
        token = queued
        if i + 1 == warmup:
            begin_timed()
        if i + 1 < total:
            queued = queue_step(token, i + 1 >= warmup)
        yield i, token.item()
