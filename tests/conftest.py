"""Shared fixtures: small real media, built here (nothing is downloaded)."""

from __future__ import annotations

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
