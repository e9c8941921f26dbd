"""Training: the stdlib text corpus, the shared training loop, and the phases built on it."""

from .loop import LoopOptions, run_loop

__all__ = ["LoopOptions", "run_loop"]
