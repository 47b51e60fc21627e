"""Content binding's cost: MediaHasher.fingerprint vs a full content hash of the same item."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from omni_requests import MediaHasher

from ._harness import Row, compare

MB = 1_000_000


def run(quick: bool) -> list[Row]:
    from PIL import Image

    hasher = MediaHasher("/models/bench-model")
    rng = np.random.default_rng(3)
    width, height = (1920, 1080) if quick else (3840, 2160)
    items = {
        f"array {16 if quick else 177} MB": (
            "image",
            rng.integers(0, 256, (16 if quick else 177) * MB, dtype=np.uint8),
        ),
        f"PIL image {width}x{height}": (
            "image",
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)),
        ),
        "video 16 frames 720p (list)": (
            "video",
            [rng.integers(0, 256, (720, 1280, 3), dtype=np.uint8) for _ in range(16)],
        ),
        "audio 30 s 16 kHz float32": ("audio", rng.standard_normal(480_000).astype(np.float32)),
    }
    rows = []
    for label, (modality, item) in items.items():
        candidates: dict[str, Callable[[], object]] = {
            "full": partial(hasher.key, modality, item),
            "fingerprint": partial(hasher.fingerprint, modality, item),
        }
        t = compare(candidates, repeat=5 if quick else 11, warmup=1)
        full, fingerprint = t["full"], t["fingerprint"]
        rows.append(
            Row(
                "binding",
                f"{label}: fingerprint",
                fingerprint.best * 1e6,
                "us",
                baseline=f"full key {full.best * 1e3:.3g} ms",
                ratio=full.best / fingerprint.best,
                note="ratio: times cheaper than the full key",
            )
        )
    return rows
