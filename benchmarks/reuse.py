"""Reuse: a frozen media item used in N records is hashed once.

The item is a record's own array (its immutable copy, backed by ``bytes``): records
given it keep it as it is, so every record's key after the first comes from the hasher's
cache. Each round starts from a fresh record's copy, so the first record's key in a
round really hashes; the baseline is that first key, on the same path.

A caller's array (any array but a record's own, read-only or not) is copied once by each
record built from it (docs/design.md): N records built separately from it make N copies
with N keys. A template built once and copied (``attrs.evolve``, scoping), or its array
handed to the next records, shares its one copy. The third figure shows what building
every record from the caller's array costs.

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
            frozen = _own(source)
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
            # Checked after the clock stops: one content key, under two replicas, and
            # every record holds the very array it was given.
            assert len({key["video"][0] for key in keys}) == 2  # type: ignore[index]
            assert all(r.multi_modal_data["video"][0] is frozen for r in records)
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
    rows.append(_built_from_the_callers_array(hasher, source, size, quick))
    return rows


def _own(source: np.ndarray) -> np.ndarray:
    """A fresh record's own copy of ``source``: records given it share it, uncopied."""
    own: np.ndarray = TextPrompt(prompt="<video>", multi_modal_data={"video": source}).multi_modal_data[
        "video"
    ][0]
    return own


def _built_from_the_callers_array(hasher: MediaHasher, source: np.ndarray, size: int, quick: bool) -> Row:
    """N records each built from the caller's own array: each copies it, and each copy is hashed."""
    n = 3 if quick else 10
    per_record, one_hash = Timing(), Timing()
    clock = time.perf_counter
    for _ in range(2 if quick else 3):
        fresh = _own(source)  # one hash, without the copy
        with no_gc():
            start = clock()
            rendered_uuids(
                scope_to_replica(
                    TextPrompt(prompt="<video>", multi_modal_data={"video": fresh}), 0, hasher=hasher
                )
            )
            hashed = clock()
            for i in range(n):
                record = TextPrompt(prompt=f"<video> question {i}", multi_modal_data={"video": source})
                rendered_uuids(scope_to_replica(record, i % 2, hasher=hasher))
            done = clock()
        one_hash.samples.append(hashed - start)
        per_record.samples.append((done - hashed) / n)
    return Row(
        "reuse",
        f"records each built from the caller's own {size} MB array (no reuse: a copy and a hash each)",
        per_record.best * 1e3,
        "ms per record",
        baseline=f"one hash {one_hash.best * 1e3:.3g} ms",
        ratio=per_record.best / one_hash.best,
        note="time ratio; build one template and copy it (attrs.evolve, scope_to_replica) to share one copy",
    )
