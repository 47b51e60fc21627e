"""Timing and reporting shared by the suites: interleaved repeats, medians, ratios, targets."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Row", "Timing", "carryover_balanced", "compare", "median_speedup", "no_gc", "speedup", "table"]


@dataclass
class Timing:
    """Seconds per call, one sample per round."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)


@contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cyclic collector from landing inside one candidate's timing."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def compare(
    candidates: dict[str, Callable[[], object]], *, repeat: int, number: int = 1, warmup: int = 1
) -> dict[str, Timing]:
    """Time every candidate about ``repeat`` times, interleaved, in a new order each round.

    Each sample is the mean of ``number`` back-to-back calls (raise it for microsecond
    work, so the timer's own cost does not count). Interleaving puts every candidate
    under the same noise. What ran just before a candidate changes its timing (a thread
    pool still awake or gone to sleep, caches flushed), so the orders are those of
    :func:`carryover_balanced`, every one used equally often (``repeat`` is rounded to a
    whole number of them): each candidate follows each other one as often as any.
    """
    names = list(candidates)
    orders = carryover_balanced(len(names))
    rounds = len(orders) * max(1, round(repeat / len(orders)))
    timings = {name: Timing() for name in names}
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    clock = time.perf_counter
    with no_gc():
        for round_ in range(rounds):
            for name in (names[i] for i in orders[round_ % len(orders)]):
                call = candidates[name]
                start = clock()
                for _ in range(number):
                    call()
                timings[name].samples.append((clock() - start) / number)
    return timings


def carryover_balanced(n: int) -> list[list[int]]:
    """Orders of ``n`` candidates in which each directly follows every other equally often.

    A Williams design: the first order is 0, 1, n-1, 2, n-2, ..., the others add 1, 2,
    ... to every index (mod n), and for odd ``n`` the reversed orders join them. A seeded
    shuffle of 31 rounds had put one candidate after single-threaded ones 17 times and
    another 10 times, which moved their threaded figures apart by several percent.
    """
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(i + shift) % n for i in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


@dataclass
class Row:
    """One reported figure: a measured value, its baseline from the same run, and a target."""

    suite: str
    name: str
    value: float
    unit: str
    baseline: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def speedup(baseline: Timing, ours: Timing) -> float:
    """How many times faster ours is than the baseline, on the fastest samples.

    Noise on a shared machine only ever adds time, so each candidate's fastest round is
    its least disturbed one (timeit's advice); rounds are interleaved, so the fastest
    rounds of two candidates saw the same machine. Medians go in the notes.
    """
    return baseline.best / ours.best


def median_speedup(baseline: Timing, ours: Timing) -> float:
    """The same ratio on medians: what a typical, disturbed call sees."""
    return baseline.median / ours.median


def fmt_ratio(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table, one suite after another."""
    header = ("suite", "figure", "value", "baseline (same run)", "ratio", "target", "")
    lines = [
        (
            r.suite,
            r.name,
            f"{r.value:.4g} {r.unit}",
            r.baseline,
            fmt_ratio(r.ratio),
            r.target,
            "" if r.met is None else ("met" if r.met else "MISSED"),
        )
        for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines, strict=True)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    return "\n".join(out)
