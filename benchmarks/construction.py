"""Construction: the one copy a record makes of an array it is given, against one hash of it.

A record owns its arrays' bytes (docs/design.md, "Why arrays are copied once"): every
array but a record's own is copied into a ``bytes`` object when the record is built.
This suite times building a ``TextPrompt`` around the caller's array (the copy plus the
record) against one hash of the same array, by our hasher and by vLLM's
``MultiModalHasher``, and building it around another record's array (no copy), which is
what templates, unpickled records and the wire format hand over. PIL images and
tensors are sealed (docs/design.md, "Tensors and PIL images: sealed"): one copy into a
sealed store, timed the same way, and a record given an untouched hand-out of another
record's image (no copy). From 64 KiB a record's copy of an array is protected (its
pages read-only while it lives): the same copy into a plain ``bytes`` object, built
with no protection to spare, is its baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from omni_requests import MediaHasher, TextPrompt, _sealed

from ._harness import Row, Timing, compare, median_speedup, speedup
from .hashing import MB, MODEL, vllm_hasher, warm_allocator


def _build(array: np.ndarray) -> TextPrompt:
    return TextPrompt(prompt="<video>", multi_modal_data={"video": array})


def _build_unprotected(array: np.ndarray) -> TextPrompt:
    """``_build`` as on a system with no protection to spare: a plain ``bytes`` copy."""
    budget = _sealed._PROTECTED
    limit, budget.limit = budget.limit, 0
    try:
        return _build(array)
    finally:
        budget.limit = limit


def run(quick: bool) -> list[Row]:
    warm_allocator()
    hash_kwargs = vllm_hasher()
    ours = MediaHasher(MODEL)
    rng = np.random.default_rng(3)
    rows: list[Row] = []
    for size in (1, 16) if quick else (1, 16, 177):
        shape = (size, 500, 666, 3)  # a video of ``size`` frames of about 1 MB each
        array = rng.integers(0, 256, shape, dtype=np.uint8)  # writable: copied, and hashed each call
        built = _build(array).multi_modal_data["video"][0]  # a record's own: taken as it is
        assert built is not array
        assert not built.flags.writeable
        assert np.array_equal(built, array)
        assert _build(built).multi_modal_data["video"][0] is built
        candidates: dict[str, Callable[[], object]] = {
            "record (copy)": partial(_build, array),
            "record (a record's array, no copy)": partial(_build, built),
            "record (copy, unprotected)": partial(_build_unprotected, array),
            "ours": partial(ours.key, "video", array),
        }
        if hash_kwargs is not None:
            candidates["vLLM"] = partial(hash_kwargs, "blake3", model_id=MODEL, video=array)
        number = 20 if size < 4 else 4 if size < 100 else 1
        t = compare(
            candidates, repeat=(5 if quick else 21) if size < 100 else (3 if quick else 11), number=number
        )
        copy, free = t["record (copy)"], t["record (a record's array, no copy)"]
        nbytes = array.nbytes
        copied = f"; {nbytes / copy.best / MB:.0f} MB/s copied"
        rows += _versus_hashes(f"array {nbytes / MB:.0f} MB: a record's one copy", t, "record (copy)", copied)
        rows.append(
            _no_copy(f"array {nbytes / MB:.0f} MB: a record given another record's array", copy, free)
        )
        plain = t["record (copy, unprotected)"]
        what = f"array {nbytes / MB:.0f} MB: a record's one copy, protected vs plain bytes"
        rows.append(_time_ratio(what, copy, plain, "plain bytes copy"))
    rows.extend(_sealed_rows(quick, ours, hash_kwargs))
    return rows


def _sealed_rows(quick: bool, ours: MediaHasher, hash_kwargs: Callable[..., object] | None) -> list[Row]:
    """The seal of a PIL image and of a tensor against one hash of each."""
    import torch
    from PIL import Image

    rng = np.random.default_rng(4)
    height, width = (1080, 1920) if quick else (2160, 3840)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    frames = 2 if quick else 8
    tensor = torch.from_numpy(rng.integers(0, 256, (frames, 720, 1280, 3), dtype=np.uint8))
    rows: list[Row] = []
    for label, modality, item in (
        (f"PIL image {width}x{height} RGB", "image", image),
        (f"tensor {tensor.numel() / MB:.0f} MB", "video", tensor),
    ):
        sealed = _record(modality, item).multi_modal_data[modality][0]
        assert sealed is not item
        assert ours.key(modality, sealed) == ours.key(modality, item)
        candidates: dict[str, Callable[[], object]] = {
            "record (seal)": partial(_record, modality, item),
            "ours": partial(ours.key, modality, item),
        }
        if modality == "image":  # an untouched hand-out takes the same seal
            candidates["record (hand-out, no copy)"] = partial(_record, modality, sealed)
        if hash_kwargs is not None:
            candidates["vLLM"] = partial(hash_kwargs, "blake3", model_id=MODEL, **{modality: item})
        t = compare(candidates, repeat=5 if quick else 15, number=1)
        seal = t["record (seal)"]
        rows += _versus_hashes(f"{label}: a record's seal (one copy)", t, "record (seal)")
        if "record (hand-out, no copy)" in t:
            free = t["record (hand-out, no copy)"]
            rows.append(_no_copy(f"{label}: a record given another record's untouched image", seal, free))
    return rows


def _versus_hashes(what: str, t: dict[str, Timing], name: str, more: str = "") -> list[Row]:
    """Rows of ``t[name]`` against one hash, ours and (when timed) vLLM's."""
    built = t[name]
    rows = []
    for hasher in ("ours", "vLLM"):
        if hasher in t:
            baseline = f"{'our' if hasher == 'ours' else 'vLLM'} hash"
            rows.append(_time_ratio(f"{what} vs one hash ({hasher})", built, t[hasher], baseline, more))
    return rows


def _time_ratio(what: str, built: Timing, base: Timing, baseline: str, more: str = "") -> Row:
    return Row(
        "construction",
        what,
        built.best * 1e3,
        "ms",
        baseline=f"{baseline} {base.best * 1e3:.3g} ms",
        ratio=built.best / base.best,
        note=f"time ratio (lower: cheaper); on medians {built.median / base.median:.2f}x{more}",
    )


def _no_copy(what: str, copied: Timing, free: Timing) -> Row:
    return Row(
        "construction",
        f"{what} (no copy)",
        free.best * 1e6,
        "us",
        baseline=f"with the copy {copied.best * 1e3:.3g} ms",
        ratio=speedup(copied, free),
        note=f"on medians {median_speedup(copied, free):.0f}x",
    )


def _record(modality: str, item: Any) -> TextPrompt:
    return TextPrompt(prompt="x", multi_modal_data={modality: [item]})
