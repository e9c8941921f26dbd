"""The bench's decode loop queues each step before it reads the one before back."""

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


def test_the_first_timed_step_is_queued_before_the_last_warm_up_token_is_read():
    log, yielded = run(2, 3)
    assert log == [
        "queue 0", "queue 1", "read 0",
        "begin", "queue 2 timed", "read 1",
        "queue 3 timed", "read 2", "queue 4 timed", "read 3", "read 4",
    ]  # fmt: skip
    assert yielded == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]


def test_no_warm_up_begins_before_the_first_step_and_no_timed_step_after_the_warm_up():
    assert run(0, 2)[0] == ["begin", "queue 0 timed", "queue 1 timed", "read 0", "read 1"]
    assert run(2, 0)[0] == ["queue 0", "queue 1", "read 0", "begin", "read 1"]
    assert run(0, 0) == ([], [])
