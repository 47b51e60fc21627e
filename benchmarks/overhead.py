"""Per-request overhead: scope_to_replica + to_vllm vs a shallow dict copy that rewrites UUIDs.

The baseline is vllm-omni's upstream fix, on a dict: copy the prompt and write the
scoped UUIDs into the copy (``{**prompt, "multi_modal_uuids": {...}}``). Ours builds
the scoped record and the engine's dict from it, fresh lists and dicts included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_requests import KeyPolicy, MediaHasher, TextPrompt, media_keys, scope_to_replica
from omni_requests_omni import CacheAffinity, RoundRobin, SelectReplica, Stage0Pool, scope_stage0
from omni_requests_vllm import to_vllm

from ._harness import Row, compare

PROMPT = "<image><image><image> What changed between these three pictures?"


def _frozen_image(seed: int) -> np.ndarray:
    image = np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    image.flags.writeable = False
    return image


def _dict_baseline(prompt: dict[str, Any]) -> Callable[[], object]:
    replica = iter(range(1 << 62))

    def scope() -> object:
        prefix = f"stage0:rep{next(replica) % 2}:"
        return {
            **prompt,
            "multi_modal_uuids": {
                m: [prefix + u for u in us] for m, us in prompt["multi_modal_uuids"].items()
            },
        }

    return scope


def _ours(record: TextPrompt, hasher: MediaHasher, policy: KeyPolicy | None = None) -> Callable[[], object]:
    replica = iter(range(1 << 62))

    def scope() -> object:
        return to_vllm(scope_to_replica(record, next(replica) % 2, hasher=hasher, policy=policy))

    return scope


def _stage0(record: TextPrompt, hasher: MediaHasher, select: SelectReplica) -> Callable[[], object]:
    # What the installed scoping does for one prompt: route, then the engine's dict.
    pool = Stage0Pool(replicas=(0, 1), select=select)

    def scope() -> object:
        return scope_stage0(record, pool=pool, hasher=hasher, as_dicts=True)

    return scope


def run(quick: bool) -> list[Row]:
    hasher = MediaHasher("/models/bench-model")
    images = [_frozen_image(seed) for seed in range(3)]
    uuids = ["photo-2024-01", "photo-2024-02", "photo-2024-03"]
    as_dict = {"prompt": PROMPT, "multi_modal_data": {"image": images}, "multi_modal_uuids": {"image": uuids}}
    with_uuids = TextPrompt(
        prompt=PROMPT, multi_modal_data={"image": images}, multi_modal_uuids={"image": uuids}
    )
    by_content = TextPrompt(prompt=PROMPT, multi_modal_data={"image": images})
    candidates: dict[str, Callable[[], object]] = {
        "dict": _dict_baseline(as_dict),
        "user uuids": _ours(with_uuids, hasher),
        "content keys": _ours(by_content, hasher),
        "user uuids, namespaces + tenant": _ours(
            with_uuids, hasher, KeyPolicy(namespaces=True, tenant="acme")
        ),
        "user uuids, content binding": _ours(
            with_uuids, hasher, KeyPolicy(namespaces=True, bind_content=True)
        ),
        # What a user's own routing reads every request: remembered per hasher and scope.
        "media_keys": functools.partial(media_keys, scope_to_replica(by_content, 1, hasher=hasher)),
    }
    t = compare(candidates, repeat=5 if quick else 21, number=2000 if quick else 10000, warmup=1)
    # Routing through scope_stage0 costs tens of microseconds: fewer calls a sample, and
    # the dict baseline timed again beside them.
    routed = compare(
        {
            "dict": candidates["dict"],
            "user uuids, RoundRobin": _stage0(with_uuids, hasher, RoundRobin()),
            "user uuids, CacheAffinity": _stage0(with_uuids, hasher, CacheAffinity()),
            "content keys, CacheAffinity": _stage0(by_content, hasher, CacheAffinity()),
        },
        repeat=5 if quick else 21,
        number=200 if quick else 1000,
        warmup=1,
    )
    base = t["dict"]
    rows = [
        Row(
            "overhead",
            "dict copy with rewritten UUIDs (the baseline)",
            base.best * 1e6,
            "us per request",
            note=f"median {base.median * 1e6:.2f} us",
        ),
    ]
    for name, target in (
        ("user uuids", 3.0),
        ("content keys", None),
        ("user uuids, namespaces + tenant", None),
        ("user uuids, content binding", None),
    ):
        ours = t[name]
        ratio = ours.best / base.best
        rows.append(
            Row(
                "overhead",
                f"scope_to_replica + to_vllm, 3 images, {name}",
                ours.best * 1e6,
                "us per request",
                baseline=f"dict {base.best * 1e6:.2f} us",
                note=f"median {ours.median * 1e6:.2f} us, {ours.median / base.median:.2f}x",
                ratio=ratio,
                target="" if target is None else f"time <= {target:.0f}x",
                met=None if target is None else ratio <= target,
            )
        )
    keys = t["media_keys"]
    rows.append(
        Row(
            "overhead",
            "media_keys of a scoped template, 3 images, content keys",
            keys.best * 1e6,
            "us per request",
            baseline=f"dict {base.best * 1e6:.2f} us",
            note=f"median {keys.median * 1e6:.2f} us",
            ratio=keys.best / base.best,
        )
    )
    routed_base = routed["dict"]
    for name in ("user uuids, RoundRobin", "user uuids, CacheAffinity", "content keys, CacheAffinity"):
        ours = routed[name]
        rows.append(
            Row(
                "overhead",
                f"scope_stage0 (as_dicts), 3 images, {name}",
                ours.best * 1e6,
                "us per request",
                baseline=f"dict {routed_base.best * 1e6:.2f} us",
                note=f"median {ours.median * 1e6:.2f} us, {ours.median / routed_base.median:.2f}x",
                ratio=ours.best / routed_base.best,
            )
        )
    return rows
