"""Progress lines of the benchmarks on stderr: how far a phase is, and about how long is left.

A phase counts its units (a round of the timed steps, one row's memory run, one point of a
sweep); after each, one line says how many are done and extrapolates the time left from the
time the done ones took. The lines go to stderr, so stdout holds only the results (and a
reader of a pipe, ``| head``, sees the table). Spawned ranks print them from rank 0: a
:class:`Progress` is plain data, shipped to the ranks with their arguments.

Example:
    >>> Progress("timing", 3, then="memory").line(1, "round 1 of 3", 10.0)
    '[bench] timing 1/3: round 1 of 3; 10 s so far, about 20 s left, then memory'
    >>> Progress("memory", 2).line(2, "floor", 7.2)
    '[bench] memory 2/2: floor; done in 7 s'
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

#: The prefix of every progress line.
PREFIX = "[bench]"


def say(line: str) -> None:
    """Print ``line`` on stderr, flushed; a closed stderr (a pipe's reader gone) is ignored."""
    with contextlib.suppress(BrokenPipeError, ValueError):  # ValueError: stderr closed
        print(line, file=sys.stderr, flush=True)


def seconds_words(seconds: float) -> str:
    """``seconds`` for a person: ``"40 s"``, ``"2 min 5 s"``.

    Example:
        >>> seconds_words(39.6), seconds_words(125.0)
        ('40 s', '2 min 5 s')
    """
    whole = round(seconds)
    return f"{whole} s" if whole < 60 else f"{whole // 60} min {whole % 60} s"


@dataclass(frozen=True)
class Progress:
    """A phase of ``total`` units; ``then`` names what runs after it (or "")."""

    phase: str
    total: int
    then: str = ""

    def line(self, done: int, what: str, elapsed: float) -> str:
        """The line after ``done`` units that took ``elapsed`` seconds; ``what``: the last."""
        head = f"{PREFIX} {self.phase} {done}/{self.total}: {what}; "
        if done >= self.total:
            tail = f"done in {seconds_words(elapsed)}"
        else:
            left = elapsed / max(done, 1) * (self.total - done)
            tail = f"{seconds_words(elapsed)} so far, about {seconds_words(left)} left"
        return head + tail + (f", then {self.then}" if self.then else "")

    def start(self) -> Ticker:
        """Start counting now."""
        return Ticker(self)


class Ticker:
    """Counts the units of one :class:`Progress` and says each on stderr."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.done = 0
        self.began = time.perf_counter()

    def ready(self) -> None:
        """Start the clock again if no unit is done yet: the set-up before the first unit
        (spawning, building, warming up) is then not counted as a unit's time."""
        if self.done == 0:
            self.began = time.perf_counter()

    def tick(self, what: str) -> None:
        """One more unit done (``what``): say so, with the time left."""
        self.done += 1
        say(self.progress.line(self.done, what, time.perf_counter() - self.began))
