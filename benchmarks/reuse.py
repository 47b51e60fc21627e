"""Reuse: a frozen media item used in N records is hashed once.

The item is a read-only array that owns its bytes, as a caller freezes a template's
media; records keep such an array as it is, so every record's key after the first comes
from the hasher's cache. Each round starts from a fresh copy of the bytes, so the first
record's key in a round really hashes; the baseline is that first key, on the same path.

Two figures: the keys of N records already scoped (what "hashed once" is about), and the
same with each record's scoping in the timing (the per-request cost on top, which the
overhead suite measures on its own).
"""

from __future__ import annotations

import time

import numpy as np

from omni_requests import MediaHasher, TextPrompt, rendered_uuids, scope_to_replica

from ._harness import Row, Timing, no_gc

MB = 1_000_000


def run(quick: bool) -> list[Row]:
    hasher = MediaHasher("/models/bench-model")
    size = 17 if quick else 177
    reuses = 100 if quick else 1000
    frames = size * MB // (720 * 1280 * 3)  # a 4-D array is one video item
    source = np.random.default_rng(1).integers(0, 256, (frames, 720, 1280, 3), dtype=np.uint8)
    rows = []
    for scoping_timed in (False, True):
        first, rest = Timing(), Timing()
        clock = time.perf_counter
        for _ in range(3 if quick else 7):
            frozen = source.copy()
            frozen.flags.writeable = False
            records = [
                TextPrompt(prompt=f"<video> question {i}", multi_modal_data={"video": frozen})
                for i in range(reuses)
            ]
            if not scoping_timed:
                records = [scope_to_replica(r, i % 2, hasher=hasher) for i, r in enumerate(records)]
            keys = []
            with no_gc():
                start = clock()
                for i, record in enumerate(records):
                    scoped = scope_to_replica(record, i % 2, hasher=hasher) if scoping_timed else record
                    keys.append(rendered_uuids(scoped))
                    if i == 0:
                        hashed = clock()
                done = clock()
            # Checked after the clock stops: one content key, under two replicas.
            assert len({key["video"][0] for key in keys}) == 2  # type: ignore[index]
            first.samples.append(hashed - start)
            rest.samples.append(done - hashed)
            del frozen, records
        # The hash and the reuses are timed apart within each round and each part is
        # taken from its own least disturbed round: noise only adds time, and a round
        # whose hash was disturbed says nothing about what the reuses cost.
        total = first.best + rest.best
        ratio = total / first.best
        per_reuse = rest.best / (reuses - 1)
        what = "scope_to_replica + keys" if scoping_timed else "keys (records scoped beforehand)"
        rows.append(
            Row(
                "reuse",
                f"{reuses} records sharing one frozen {size} MB video: {what}",
                total * 1e3,
                "ms",
                baseline=f"the first record's (one hash) {first.best * 1e3:.3g} ms",
                ratio=ratio,
                target="" if scoping_timed else "time <= 1.1x",
                met=None if scoping_timed else ratio <= 1.1,
                note=f"{per_reuse * 1e6:.2f} us per reuse; on medians {1 + rest.median / first.median:.2f}x",
            )
        )
    return rows
