"""Shared fixtures: small real media, built here (nothing is downloaded)."""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import numpy as np
import pytest

from omni_requests import MediaHasher


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def hasher() -> MediaHasher:
    return MediaHasher("/models/tiny-vl")


def video(seed: int, frames: int = 3, side: int = 8) -> np.ndarray:
    """A small random uint8 video, distinct per seed."""
    return np.random.default_rng(seed).integers(0, 256, (frames, side, side, 3), dtype=np.uint8)


def numpy_text_beyond_unicode(text: str) -> np.ndarray:
    """``text`` (three characters) in a numpy string array whose last one is code point
    0x1000000: numpy builds such strings, no Python-made ``str`` can hold one."""
    array = np.array([text[:2] + "\U00100000"], dtype="<U3")
    array.view(np.uint32)[2] = 0x1000000
    return array


def record_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, argument: int) -> list[object]:
    """Wrap ``owner.name`` so every call still runs and its positional ``argument`` is recorded."""
    seen: list[object] = []
    real = getattr(owner, name)

    def recording(*args: object) -> object:
        seen.append(args[argument])
        return real(*args)

    monkeypatch.setattr(owner, name, recording)
    return seen


class CountingHasher(MediaHasher):
    """A MediaHasher that counts the digests it computes (a cache hit computes none).

    Counts are per class, across instances: reset ``computed`` before counting.
    """

    computed: ClassVar[Counter[str]] = Counter()

    def _digest(self, modality: str, item: object, *leaf: Any) -> str:
        digest = super()._digest(modality, item, *leaf)
        CountingHasher.computed[digest] += 1
        return digest
