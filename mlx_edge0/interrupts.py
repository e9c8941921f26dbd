"""SIGTERM taken as Ctrl-C, so a stopped command cleans up as an interrupted one does.

Python's default SIGTERM ends the process at once: no ``finally``, no
``__exit__``. ``edge0 serve`` stops its server process, and ``edge0 bench``
kills an arm's process and removes the cgroups it made for it, only on the way
out of an exception: SIGTERM has to arrive as one.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM raises KeyboardInterrupt (main thread only:
    elsewhere Python cannot set a handler, and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, saved)
