"""An exception landing mid-hand-over never leaves an image-hashing helper blocked (issue 13, class 6).

A signal's ``KeyboardInterrupt`` lands in the calling thread between two bytecodes: while
a large RGB image is hashed, that may be between any two steps of a hand-over with the
helper thread. Each step named in ``HANDOVER_POINTS`` is tried in turn through the
road's test seam, deterministically: the exception reaches the caller, the helper goes
back to being idle, and the next large image takes the two-thread road again, with the
right digest.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from blake3 import blake3
from PIL import Image

from omni_requests import MediaHasher
from omni_requests import _image_road as road

LARGE = (2001, 1401)  # 8.4 MB of RGB pixels: packed while a helper thread hashes


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (LARGE[1], LARGE[0], 3), np.uint8))


class _Digest:
    """blake3, noting which threads fed it."""

    def __init__(self) -> None:
        self.digest = blake3()
        self.threads: set[str] = set()

    def update(self, chunk: Any) -> None:
        self.threads.add(threading.current_thread().name)
        self.digest.update(chunk)


class _SlowFirstBand:
    """A clock under which the first band looks like it waited for the GIL: the bands end there."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every step "takes" a second, far above _GIL_WAIT
        return self.now


@pytest.fixture
def helpers(monkeypatch: pytest.MonkeyPatch) -> road._Helpers:
    """One helper of our own: losing it loses the two-thread road."""
    own = road._Helpers(limit=1)
    monkeypatch.setattr(road, "_HELPERS", own)
    assert road._band_packing_works()
    return own


def test_every_hand_over_point_is_reached_on_the_two_thread_road(
    helpers: road._Helpers, monkeypatch: pytest.MonkeyPatch
) -> None:
    reached: list[str] = []
    monkeypatch.setattr(road, "_handover", reached.append)
    for _ in range(2):  # the first call starts the helper, the second hands a job to it kept
        road.pixels(_image(0)).feed(_Digest().update)
    monkeypatch.setattr(road, "_clock", _SlowFirstBand())
    road.pixels(_image(0)).feed(_Digest().update)
    assert set(reached) == set(road.HANDOVER_POINTS)


@pytest.mark.parametrize("point", road.HANDOVER_POINTS)
def test_an_interrupt_at_each_hand_over_point_leaves_the_helper_free(
    point: str, helpers: road._Helpers, monkeypatch: pytest.MonkeyPatch
) -> None:
    if point != "helper started":  # every other point needs a kept helper
        road.pixels(_image(1)).feed(_Digest().update)
        assert helpers.count() == (1, 1)
    hits: list[str] = []

    def interrupt(at: str) -> None:
        if at == point and not hits:
            hits.append(at)
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(road, "_handover", interrupt)
        if point == "end of bands told":
            patch.setattr(road, "_clock", _SlowFirstBand())
        with pytest.raises(KeyboardInterrupt):
            road.pixels(_image(2)).feed(_Digest().update)
    assert hits == [point]

    # The helper is idle again, not blocked waiting for slots that never come.
    assert helpers.wait_idle(timeout=30), f"the helper is stuck after an interrupt at {point!r}"
    assert helpers.count() == (1, 1)

    # The next large image takes the two-thread road again, and its digest is right.
    image = _image(3)
    fed = _Digest()
    assert road.pixels(image).feed(fed.update) == LARGE[0] * LARGE[1] * 3
    assert "omni-requests hashing" in fed.threads
    assert fed.digest.hexdigest() == blake3(image.tobytes()).hexdigest()
    hasher = MediaHasher("/m")
    key = hasher.key("image", image)
    monkeypatch.setattr(road, "ENABLED", False)
    assert key == hasher.key("image", image)
