"""The bench's decode loop queues each step before it reads the one before back."""

import pytest

from mlx_edge0.bench.decode_loop import pipelined_steps


class Token:
    """A token array stand-in that logs when it is read back."""

    def __init__(self, n: int, log: list):
        self.n, self.log = n, log

    def item(self) -> int:
        self.log.append(f"read {self.n}")
        return self.n


def run(warmup: int, timed: int) -> tuple[list, list]:
    log: list = []

    def queue_step(prev: Token, timed_step: bool) -> Token:
        log.append(f"queue {prev.n + 1}{' timed' if timed_step else ''}")
        return Token(prev.n + 1, log)

    yielded = list(pipelined_steps(Token(-1, log), queue_step, warmup, timed, lambda: log.append("begin")))
    return log, yielded


def test_each_token_is_read_back_after_the_next_step_is_queued_and_the_window_holds_n_builds():
    log, yielded = run(2, 3)
    assert log == [
        "queue 0", "queue 1", "read 0", "queue 2",
        "begin", "read 1",  # the window opens: steps 0-2 built, the last warm-up token not read yet
        "queue 3 timed", "read 2", "queue 4 timed", "read 3", "queue 5 timed", "read 4",
        "read 5",  # the step queued after the last timed token, read after the last yield
    ]  # fmt: skip
    assert yielded == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]


def test_no_timed_step_leaves_nothing_queued_and_the_window_needs_a_warm_up_step():
    assert run(2, 0) == (["queue 0", "queue 1", "read 0", "begin", "read 1"], [(0, 0), (1, 1)])
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        run(0, 2)
