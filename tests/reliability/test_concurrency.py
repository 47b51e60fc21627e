"""Shared templates scoped from many threads and asyncio tasks at once.

Every scoping is checked against keys computed up front, single-threaded: zero wrong
keys are allowed, and the templates must come out exactly as they went in. The caches
on the path (content keys, fingerprints, scopes, plain maps) are shared by all workers,
and some templates hold writable arrays (never cached: hashed every time) while others
hold frozen ones (cached), so both roads run concurrently.

Default: 16 workers x 300 scopings. ``pytest -m slow tests/reliability``: 16 x 10,000.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from omni_requests import (
    KeyPolicy,
    MediaHasher,
    TextPrompt,
    TokensPrompt,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests import _image_road as road
from omni_requests_vllm import to_vllm

from ._inputs import snapshot

WORKERS = 16
REPLICAS = 4
POLICIES = [None, KeyPolicy(namespaces=True, tenant="t1"), KeyPolicy(bind_content=True, tenant="t2")]


def _media(seed: int, *, frozen: bool) -> np.ndarray:
    array = np.random.default_rng(seed).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    array.flags.writeable = not frozen
    return array


def _templates() -> list[Any]:
    return [
        TextPrompt(prompt="<video>", multi_modal_data={"video": _media(1, frozen=True)}),
        TextPrompt(prompt="<video>", multi_modal_data={"video": _media(2, frozen=False)}),
        TextPrompt(
            prompt="<image><image>",
            multi_modal_data={"image": [_media(3, frozen=True)[0], _media(4, frozen=False)[0]]},
            multi_modal_uuids={"image": ["cat", None]},
        ),
        TokensPrompt(
            prompt_token_ids=[1, 2, 3],
            multi_modal_data={"audio": (np.linspace(0, 1, 64, dtype=np.float32), 16000)},
            multi_modal_uuids={"audio": ["clip-1"]},
        ),
    ]


class Oracle:
    """Keys for every (template, replica, policy), computed once before the workers start."""

    def __init__(self, templates: list[Any], hasher: MediaHasher) -> None:
        self.templates = templates
        self.hasher = hasher
        self.expected = {
            (t, r, p): rendered_uuids(scope_to_replica(templates[t], r, hasher=hasher, policy=POLICIES[p]))
            for t in range(len(templates))
            for r in range(REPLICAS)
            for p in range(len(POLICIES))
        }
        self.before = snapshot(templates)
        self.deep = copy.deepcopy(templates)
        self.wrong: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def one(self, rng: random.Random) -> None:
        t, r, p = rng.randrange(len(self.templates)), rng.randrange(REPLICAS), rng.randrange(len(POLICIES))
        # A fresh, equal hasher now and then: scope lookups must not depend on identity.
        hasher = self.hasher if rng.random() < 0.9 else MediaHasher(self.hasher.model_id)
        scoped = scope_to_replica(self.templates[t], r, hasher=hasher, policy=POLICIES[p])
        got = rendered_uuids(scoped)
        sent = to_vllm(scoped).get("multi_modal_uuids")
        if got != self.expected[(t, r, p)] or sent != got:
            with self.lock:
                self.wrong.append((t, r, p, got, sent))

    def check(self) -> None:
        assert self.wrong == []
        assert snapshot(self.templates) == self.before
        assert self.templates == self.deep
        assert all(t.scope is None for t in self.templates)


@pytest.fixture
def oracle() -> Oracle:
    return Oracle(_templates(), MediaHasher("/models/concurrency"))


def _churn(stop: threading.Event) -> None:
    """Frozen arrays born and dying the whole time: the key cache drops entries under load."""
    hasher = MediaHasher("/models/concurrency")
    i = 0
    while not stop.is_set():
        array = _media(1000 + i % 7, frozen=True)
        hasher.key("video", array)
        hasher.fingerprint("video", array)
        i += 1


def _run_threads(oracle: Oracle, per_worker: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import omni_requests._scoping as scoping

    monkeypatch.setattr(scoping, "_MAX_SCOPES", 8)  # the scope and rendering caches clear often
    barrier = threading.Barrier(WORKERS)
    stop = threading.Event()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        barrier.wait()
        for _ in range(per_worker):
            oracle.one(rng)

    churn = threading.Thread(target=_churn, args=(stop,))
    churn.start()
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(work, range(WORKERS)))
    finally:
        stop.set()
        churn.join()
    oracle.check()


async def _run_tasks(oracle: Oracle, per_worker: int, offload: Callable[..., Any] | None) -> None:
    async def work(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(per_worker):
            if offload is not None and i % 10 == 0:
                await offload(oracle.one, rng)  # some of it on the default executor's threads
            else:
                oracle.one(rng)
            await asyncio.sleep(0)  # let the other tasks in between every scoping

    await asyncio.gather(*(work(seed) for seed in range(WORKERS)))
    oracle.check()


def test_threads(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_threads(oracle, 300, monkeypatch)


def test_asyncio_tasks(oracle: Oracle) -> None:
    asyncio.run(_run_tasks(oracle, 300, asyncio.to_thread))


@pytest.mark.slow
def test_threads_long(oracle: Oracle, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_threads(oracle, 10_000, monkeypatch)


@pytest.mark.slow
def test_asyncio_tasks_long(oracle: Oracle) -> None:
    asyncio.run(_run_tasks(oracle, 10_000, asyncio.to_thread))


def test_the_oracle_catches_a_wrong_key(oracle: Oracle) -> None:
    oracle.expected[(0, 0, 0)] = {"video": ["stage0:rep0:not-the-key"]}
    rng = random.Random(0)
    while not oracle.wrong:
        oracle.one(rng)
    with pytest.raises(AssertionError):
        oracle.check()


def test_the_oracle_catches_a_changed_template(oracle: Oracle) -> None:
    # Records cannot be written (their arrays are immutable), so a template is replaced.
    oracle.templates[1] = oracle.templates[1].replace_media({"video": _media(99, frozen=False)})
    with pytest.raises(AssertionError):
        oracle.check()


def test_large_images_hashed_from_many_threads_at_once() -> None:
    # From 4 MiB of pixels an RGB image is packed by its caller while a helper thread
    # hashes; concurrent callers each have their own slots, and a helper or none.
    from PIL import Image

    images = [
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (1401, 2001, 3), dtype=np.uint8))
        for seed in range(4)
    ]
    hasher = MediaHasher("m")
    expected = [hasher.key("image", image) for image in images]  # one at a time
    assert len(set(expected)) == 4
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda i: hasher.key("image", images[i % 4]), range(32)))
    assert keys == [expected[i % 4] for i in range(32)]
    # Callers beyond the helpers hash on their own thread: helpers never outnumber the cores.
    assert 1 <= road._HELPERS.count().started <= len(os.sched_getaffinity(0))
