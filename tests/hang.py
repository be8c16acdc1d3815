"""A guard for fuzz tests: a parser that hangs must fail the test, never pass as a rejection."""

import contextlib
import signal


class Hang(Exception):
    """Not a ValueError: a hang must fail the test, never pass as a rejection."""


@contextlib.contextmanager
def no_hang(seconds: float = 10.0):
    def fire(signum, frame):
        raise Hang(f"no result after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
