"""Routing: ``CacheAffinity`` plus conversion through ``scope_stage0``, against one hash.

vllm-omni's stage 0 picks a replica (``CacheAffinity`` reads the request's media keys)
and then scopes the request to it. Within one call of ``scope_stage0`` the keys routing
computed are the keys its dicts are rendered with (``one_request``), so each item should
be hashed at most once a request. Requests, each with media never seen before:

- a plain dict holding the caller's writable 19 MB video: ``from_vllm`` builds a record,
  which copies the array once (the trust rule: records own their arrays), then one hash;
- a record of a 19 MB video built beforehand (its copy made outside the timing), and the
  same record reused (its key already known: no hash at all);
- a 4K PIL image in a dict: a dict's media are read as they are (not sealed), so one
  hash per request is the floor;
- a 4K PIL image and a 19 MB tensor video, each in a record built beforehand: the record
  sealed its item (one copy, outside the timing), and the first request hashes the
  sealed store once (its pages read for the first time); later requests of that record
  would hash nothing, as for the reused array;
- the PIL record handed back as a record and rendered by a separate ``to_vllm``: the
  key routing computed is the seal's, so the later render reuses it (shown, not judged).

Records are scoped with ``as_dicts=True`` (what the installed scoping does): the call
returns the engine's dicts. Each figure is the request's time against one hash of the
same item (``MediaHasher.key`` of an item whose key is not cached: every call hashes), and
the number of digests actually computed, counted by a ``MediaHasher`` subclass.
"""

from __future__ import annotations

import importlib
import importlib.util
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

    def _digest(self, modality: str, item: object, *leaf: Any) -> str:
        type(self).digests += 1
        return super()._digest(modality, item, *leaf)


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

    # A core-only environment has no torch: no tensor row there.
    torch: Any = importlib.import_module("torch") if importlib.util.find_spec("torch") else None
    image = f"PIL image {'1080p' if quick else '4K'} RGB"
    mb = f"{video.nbytes / MB:.0f} MB"
    # (label, request for round n, the item hashed once as the baseline, its bytes, as_dicts)
    cases: list[tuple[str, Callable[[int], object], Callable[[int], object], int, bool]] = [
        (
            f"dict with the caller's writable {mb} video",
            lambda n: {"prompt": "<video>", "multi_modal_data": {"video": fresh(n)}},
            fresh,
            video.nbytes,
            False,
        ),
        (
            f"record of a {mb} video, first request",
            lambda n: TextPrompt(prompt="<video>", multi_modal_data={"video": fresh(n)}),
            fresh,
            video.nbytes,
            True,
        ),
        (f"record of a {mb} video, reused", lambda n: reused, fresh, video.nbytes, True),
        (
            f"dict with a {image}",
            lambda n: {"prompt": "<image>", "multi_modal_data": {"image": Image.fromarray(pixels)}},
            lambda n: Image.fromarray(pixels),
            pixels.nbytes,
            False,
        ),
        (
            f"record of a {image}",
            lambda n: TextPrompt(prompt="<image>", multi_modal_data={"image": Image.fromarray(pixels)}),
            lambda n: Image.fromarray(pixels),
            pixels.nbytes,
            True,
        ),
        (
            f"record of a {image}, handed back as a record, then to_vllm",
            lambda n: TextPrompt(prompt="<image>", multi_modal_data={"image": Image.fromarray(pixels)}),
            lambda n: Image.fromarray(pixels),
            pixels.nbytes,
            False,
        ),
    ]
    if torch is not None:
        tensor = torch.from_numpy(video)
        cases.insert(
            3,
            (
                f"record of a {mb} tensor video",
                lambda n: TextPrompt(
                    prompt="<video>", multi_modal_data={"video": torch.from_numpy(fresh(n))}
                ),
                lambda n: tensor,
                video.nbytes,
                True,
            ),
        )
    rows = []
    clock = time.perf_counter
    n = 1
    for label, request, item_for_hash, nbytes, as_dicts in cases:
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
                        replica, scoped = scope_stage0(
                            prompt, pool=pool, hasher=hasher, request_id=f"r{n}", as_dicts=as_dicts
                        )
                        if isinstance(scoped, TextPrompt):  # a record handed back: render it
                            scoped = to_vllm(scoped)
                        routed.samples.append(clock() - start)
                        counts.append(_Counting.digests - before)
                assert replica in (0, 1)
                assert scoped["multi_modal_uuids"][modality][0].startswith(f"stage0:rep{replica}:")
                del prompt, item, scoped
        ratio = routed.best / one_hash.best
        most = max(counts)
        judged = "reused" not in label and "handed back" not in label
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
