"""Routing: ``CacheAffinity`` plus conversion through ``scope_stage0``, against one hash.

vllm-omni's stage 0 picks a replica (``CacheAffinity`` reads the request's media keys)
and then scopes the request to it (a dict comes back as the dict of its scoped record; a
record comes back scoped, and ``to_vllm`` of it, timed too, renders the same keys). An array item should be hashed at most once for both: the one time its key is
computed. Four requests, each with one 19 MB video and media never seen before:

- a plain dict holding the caller's writable array: ``from_vllm`` builds a record, which
  copies the array once; its key is computed for routing and found in the cache for
  conversion;
- a record built beforehand from the caller's array (its copy made outside the timing);
- a record reused (its key already known): no hash at all;
- a PIL image in a record: images are never cached (nothing stops writes to them), so
  routing and conversion each hash it.

Each figure is the request's time against one hash of the same item (``MediaHasher.key``
of a writable copy: every call hashes), and the number of digests actually computed,
counted by a ``MediaHasher`` subclass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_requests import MediaHasher, TextPrompt

from ._harness import Row, Timing, no_gc
from .hashing import MB, MODEL, warm_allocator


class _Counting(MediaHasher):
    """A MediaHasher that counts the digests it computes (cache hits are not counted)."""

    digests = 0

    def _digest(self, modality: str, item: object) -> str:
        type(self).digests += 1
        return super()._digest(modality, item)


def run(quick: bool) -> list[Row]:
    from omni_requests_omni import CacheAffinity, Stage0Pool, scope_stage0
    from omni_requests_vllm import to_vllm

    warm_allocator()
    hasher = _Counting(MODEL)
    plain = MediaHasher(MODEL)
    pool = Stage0Pool(replicas=(0, 1), select=CacheAffinity())
    rng = np.random.default_rng(11)
    frames = 2 if quick else 7  # 7 frames of 720p: 19 MB
    video = rng.integers(0, 256, (frames, 720, 1280, 3), dtype=np.uint8)
    rounds = 3 if quick else 9
    from PIL import Image

    pixels = rng.integers(0, 256, (1080, 1920, 3) if quick else (2160, 3840, 3), dtype=np.uint8)

    def fresh(n: int) -> np.ndarray[Any, Any]:
        out = video.copy()
        out.reshape(-1)[:8] = n % 251
        return out

    reused = TextPrompt(prompt="<video>", multi_modal_data={"video": fresh(0)})
    scope_stage0(reused, pool=pool, hasher=hasher)

    cases: list[tuple[str, Callable[[int], object], Callable[[int], object], int]] = [
        (
            f"dict with the caller's writable {video.nbytes / MB:.0f} MB video",
            lambda n: {"prompt": "<video>", "multi_modal_data": {"video": fresh(n)}},
            fresh,
            video.nbytes,
        ),
        (
            f"record of a {video.nbytes / MB:.0f} MB video, first request",
            lambda n: TextPrompt(prompt="<video>", multi_modal_data={"video": fresh(n)}),
            fresh,
            video.nbytes,
        ),
        (f"record of a {video.nbytes / MB:.0f} MB video, reused", lambda n: reused, fresh, video.nbytes),
        (
            f"record of a PIL image {'1080p' if quick else '4K'} RGB",
            lambda n: TextPrompt(prompt="<image>", multi_modal_data={"image": Image.fromarray(pixels)}),
            lambda n: Image.fromarray(pixels),
            pixels.nbytes,
        ),
    ]
    rows = []
    clock = time.perf_counter
    n = 1
    for label, request, item_for_hash, nbytes in cases:
        modality = "image" if "PIL" in label else "video"
        routed, one_hash = Timing(), Timing()
        counts = []
        # One collection before the rounds, none inside: with vLLM and torch loaded (the
        # frontend suite runs first) a full collection takes most of a second.
        with no_gc():
            for round_ in range(rounds):
                n += 1
                prompt, item = request(n), item_for_hash(n)
                scoped: Any = None
                for which in ("route", "hash") if round_ % 2 else ("hash", "route"):
                    if which == "hash":
                        start = clock()
                        plain.key(modality, item)
                        one_hash.samples.append(clock() - start)
                    else:
                        before = _Counting.digests
                        start = clock()
                        replica, scoped = scope_stage0(prompt, pool=pool, hasher=hasher, request_id=f"r{n}")
                        if isinstance(scoped, TextPrompt):  # records come back as records
                            scoped = to_vllm(scoped)
                        routed.samples.append(clock() - start)
                        counts.append(_Counting.digests - before)
                assert replica in (0, 1)
                assert scoped["multi_modal_uuids"][modality][0].startswith(f"stage0:rep{replica}:")
                del prompt, item, scoped
        ratio = routed.best / one_hash.best
        most = max(counts)
        judged = modality == "video" and "reused" not in label
        rows.append(
            Row(
                "affinity",
                f"{label}: CacheAffinity + to_vllm via scope_stage0 ({most} digest{'s' if most != 1 else ''} a request)",
                routed.best * 1e3,
                "ms per request",
                baseline=f"one hash {one_hash.best * 1e3:.3g} ms ({nbytes / MB:.0f} MB)",
                ratio=ratio,
                target="time <= 1.05x" if judged else "",
                met=ratio <= 1.05 if judged else None,
                note=f"time ratio; on medians {routed.median / one_hash.median:.2f}x; digests per request {sorted(set(counts))}",
            )
        )
    return rows
