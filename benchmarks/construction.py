"""Construction: the one copy a record makes of an array it is given, against one hash of it.

A record owns its arrays' bytes (docs/design.md, "Why arrays are copied once"): an
array that is not already read-only down to a ``bytes`` object is copied into one when
the record is built. This suite times building a ``TextPrompt`` around a writable
array (the copy plus the record) against one hash of the same array, by our hasher and
by vLLM's ``MultiModalHasher``, and building it around an array already backed by
``bytes`` (no copy), which is what decoders and ``pickle`` hand over.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from omni_requests import MediaHasher, TextPrompt

from ._harness import Row, compare, median_speedup, speedup
from .hashing import MB, MODEL, vllm_hasher, warm_allocator


def _build(array: np.ndarray) -> TextPrompt:
    return TextPrompt(prompt="<video>", multi_modal_data={"video": array})


def run(quick: bool) -> list[Row]:
    warm_allocator()
    hash_kwargs = vllm_hasher()
    ours = MediaHasher(MODEL)
    rng = np.random.default_rng(3)
    rows: list[Row] = []
    for size in (1, 16) if quick else (1, 16, 177):
        shape = (size, 500, 666, 3)  # a video of ``size`` frames of about 1 MB each
        array = rng.integers(0, 256, shape, dtype=np.uint8)  # writable: copied, and hashed each call
        as_bytes = np.frombuffer(array.tobytes(), np.uint8).reshape(array.shape)  # taken as it is
        built = _build(array).multi_modal_data["video"][0]
        assert built is not array
        assert not built.flags.writeable
        assert np.array_equal(built, array)
        assert _build(as_bytes).multi_modal_data["video"][0] is as_bytes
        candidates: dict[str, Callable[[], object]] = {
            "record (copy)": partial(_build, array),
            "record (bytes-backed, no copy)": partial(_build, as_bytes),
            "ours": partial(ours.key, "video", array),
        }
        if hash_kwargs is not None:
            candidates["vLLM"] = partial(hash_kwargs, "blake3", model_id=MODEL, video=array)
        number = 20 if size < 4 else 4 if size < 100 else 1
        t = compare(
            candidates, repeat=(5 if quick else 21) if size < 100 else (3 if quick else 11), number=number
        )
        copy, free = t["record (copy)"], t["record (bytes-backed, no copy)"]
        nbytes = array.nbytes
        for name in ("ours", "vLLM"):
            if name not in t:
                continue
            base = t[name]
            rows.append(
                Row(
                    "construction",
                    f"array {nbytes / MB:.0f} MB: a record's one copy vs one hash ({name})",
                    copy.best * 1e3,
                    "ms",
                    baseline=f"{'our' if name == 'ours' else 'vLLM'} hash {base.best * 1e3:.3g} ms",
                    ratio=copy.best / base.best,
                    note=f"time ratio (lower: cheaper); on medians {copy.median / base.median:.2f}x; "
                    f"{nbytes / copy.best / MB:.0f} MB/s copied",
                )
            )
        rows.append(
            Row(
                "construction",
                f"array {nbytes / MB:.0f} MB: a record given a bytes-backed array (no copy)",
                free.best * 1e6,
                "us",
                baseline=f"with the copy {copy.best * 1e3:.3g} ms",
                ratio=speedup(copy, free),
                note=f"on medians {median_speedup(copy, free):.0f}x",
            )
        )
    return rows
