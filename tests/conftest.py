"""Shared fixtures: small real media, built here (nothing is downloaded)."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

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

    def _digest(self, modality: str, item: object) -> str:
        digest = super()._digest(modality, item)
        CountingHasher.computed[digest] += 1
        return digest
