"""Progress of long work: one tqdm bar per job on stderr, with a rate and an ETA.

Every slow loop of the ``edge0`` commands (tokenizing the corpus, training
steps, scoring held-out text, generating training text, benchmark runs)
reports through here, so all progress looks alike and stdout keeps only a
command's result (e.g. its JSON). Library callers and tests pass
``show=False`` (``show_progress=False`` at the entry points) for silence;
messages go through :func:`note`, which does not break a bar being drawn.
"""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, Optional, TypeVar

from tqdm import tqdm

T = TypeVar("T")

# Redraw often on a terminal; in a log file every redraw is kept, so rarely.
TTY_INTERVAL_S, LOG_INTERVAL_S = 0.2, 10.0


def bar(
    total: Optional[float],
    label: str,
    *,
    unit: str = "it",
    unit_scale: bool = False,
    initial: int = 0,
    show: bool = True,
) -> tqdm:
    """A bar counting ``total`` units of work (``initial`` of them already done).

    The ETA is the mean rate since the bar opened (``smoothing=0``): work
    items here (runs, steps, windows) vary too much one to the next for a
    moving average, and work done before (``initial``, e.g. a resume) does
    not count towards the rate. Close it (or use it in ``with``) when done.
    """
    return tqdm(
        total=total,
        desc=label,
        unit=unit,
        unit_scale=unit_scale,
        initial=initial,
        disable=not show,
        file=sys.stderr,
        smoothing=0,
        dynamic_ncols=True,
        mininterval=TTY_INTERVAL_S if sys.stderr.isatty() else LOG_INTERVAL_S,
    )


def track(
    items: Iterable[T], label: str, *, total: Optional[int] = None, unit: str = "it", show: bool = True
) -> Iterator[T]:
    """Yield ``items`` while a :func:`bar` counts them."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar(total, label, unit=unit, show=show) as b:
        for item in items:
            yield item
            b.update()


def note(line: str) -> None:
    """One message line on stderr, printed above any bar being drawn."""
    tqdm.write(line, file=sys.stderr)
