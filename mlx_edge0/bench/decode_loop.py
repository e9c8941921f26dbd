"""The bench's decode loop, pipelined as mlx-lm's ``generate_step`` runs it.

``generate_step`` builds and queues step t+1 (``async_eval``) before it reads
step t's token back, from the step after the prompt's last token on, so the
host's work for a step (a prerouted step's fills start when it opens)
overlaps the compute of the one before, and the time between two tokens'
read-backs holds the host's work for one step. The bench decodes warm-up
steps and then timed ones the same way throughout, so its timed window is
a stretch of that steady state: it opens at the last warm-up token's
read-back and closes at the last timed token's, and the N steps built in
it are the next N, the one queued after the last timed token included (as
``generate_step`` queues it). The pipeline starts in the warm-up, where
``generate_step``'s starts in the prompt's last token; a window opened
before its first step is built would hold that start, and one that closed
with nothing queued after its last token would end on a step whose compute
had mostly run in the interval before.
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

    ``queue_step(prev, in_window)`` builds and queues the step after token
    ``prev`` (an array that may still be computing) and returns its token
    array; ``in_window`` says the step is built inside the timed window.
    ``begin_timed()`` runs when the window opens, right before the last
    warm-up token is read back (every step built before it has done its
    host work, reads included), so what it snapshots (counters, device
    bytes, the cache's contents) and what the caller reads after the last
    yield cover exactly the window's N builds. Steps ``warmup`` onward are
    the timed tokens: a step's time is from the read-back of the token before
    to its own. The step queued after the last timed token is read back after
    the last yield, so nothing is in flight when the loop ends.
    """
    if warmup < 1:
        raise ValueError("the timed window opens at a warm-up token's read-back: warmup must be at least 1")
    total = warmup + timed
    queued = queue_step(first, False)
    for i in range(total):
        token = queued
        if i + 1 < total or timed:
            queued = queue_step(token, i + 1 > warmup)
        if i + 1 == warmup:
            begin_timed()
        yield i, token.item()
    if timed:
        queued.item()
