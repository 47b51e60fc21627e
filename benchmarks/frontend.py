"""The frontend: per-request time through vLLM's real renderer, records against plain dicts.

One renderer is one vLLM frontend (tiny Qwen2-VL and Qwen2-Audio folders from
``tests/vllm/_tiny_models.py``, no weights; processor cache on, vLLM's default). A
template is reused with the same media: the dict path hands vLLM the media and vLLM
hashes it on every request; the record path hands it ``to_vllm(scope_to_replica(...))``
of one template record, whose keys vLLM takes as they are. Both paths hit the processor
cache on reuse (checked: no features are sent), so what is left is each path's own work.

First use: each round both paths get media never seen before; the record path's timing
includes building the record (its one copy of an array, or the seal of an image or
tensor) and its key.

Each figure is measured with idle cores and again with a thread busy in Python in the
same process, as a server's event loop would be. Without vLLM the suite reports nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import import_module
from pathlib import Path
from typing import Any

import numpy as np

from omni_requests import MediaHasher, TextPrompt, scope_to_replica

from ._harness import Row, Timing, compare, median_speedup, no_gc, speedup
from .hashing import MB, _thread_busy_in_python, warm_allocator

TESTS_VLLM = Path(__file__).resolve().parents[1] / "tests" / "vllm"

Make = Callable[[int], Any]  # a variant number -> a media item (0: the template's)


def _render(renderer: Any, prompt: Any) -> Any:
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    (result,) = renderer.render_cmpl([parse_model_prompt(renderer.model_config, prompt)])
    return result


def _kinds(quick: bool) -> list[tuple[str, str, Make, int]]:
    """(label, modality, make, bytes) per media kind; ``make(n)`` differs in content for each n."""
    import torch
    from PIL import Image

    rng = np.random.default_rng(7)
    frames = 2 if quick else 8
    video = rng.integers(0, 256, (frames, 720, 1280, 3), dtype=np.uint8)
    height, width = (1080, 1920) if quick else (2160, 3840)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    seconds = 60 if quick else 262
    audio = rng.standard_normal(16_000 * seconds).astype(np.float32)

    def variant(base: np.ndarray[Any, Any], n: int) -> np.ndarray[Any, Any]:
        out = base.copy()  # writable, as a decoder hands it over
        out.reshape(-1)[:8] = n % 251
        return out

    name = "1080p" if quick else "4K"
    kinds = [
        (f"video array {frames} frames 720p", "video", lambda n: variant(video, n), video.nbytes),
        (f"PIL image {name} RGB", "image", lambda n: Image.fromarray(variant(pixels, n)), pixels.nbytes),
        (
            f"video tensor {frames} frames 720p",
            "video",
            lambda n: torch.from_numpy(variant(video, n)),
            video.nbytes,
        ),
        (f"audio {seconds} s 16 kHz float32", "audio", lambda n: (variant(audio, n), 16_000), audio.nbytes),
    ]
    return kinds[:2] if quick else kinds  # --quick: a smoke test of an array and a sealed image


def run(quick: bool) -> list[Row]:
    try:
        import vllm.renderers  # noqa: F401
    except ImportError:
        return []
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, str(TESTS_VLLM))
    tm: Any = import_module("_tiny_models")  # the tests' tiny model folders

    warm_allocator()
    root = Path(tempfile.mkdtemp(prefix="omni-bench-frontend-"))
    renderers = {"qwen2_vl": tm.build_renderer(tm.make_qwen2_vl(root / "qwen2_vl"))}
    if not quick:
        renderers["qwen2_audio"] = tm.build_renderer(tm.make_qwen2_audio(root / "qwen2_audio"))
    prompts = {
        "video": tm.qwen2_vl_prompt({"video": 1}),
        "image": tm.qwen2_vl_prompt({"image": 1}),
        "audio": tm.qwen2_audio_prompt({"audio": 1}),
    }
    rows: list[Row] = []
    fresh = iter(range(1, 1 << 30))
    for label, modality, make, nbytes in _kinds(quick):
        renderer = renderers["qwen2_audio" if modality == "audio" else "qwen2_vl"]
        for busy in (False,) if quick else (False, True):
            with _thread_busy_in_python() if busy else contextlib.nullcontext():
                rows += _reuse(renderer, label, modality, prompts[modality], make, nbytes, busy, quick, fresh)
                rows += _first_use(
                    renderer, label, modality, prompts[modality], make, nbytes, busy, quick, fresh
                )
    return rows


def _reuse(
    renderer: Any,
    label: str,
    modality: str,
    prompt: str,
    make: Make,
    nbytes: int,
    busy: bool,
    quick: bool,
    fresh: Iterator[int],
) -> list[Row]:
    from omni_requests_vllm import to_vllm

    hasher = MediaHasher(renderer.model_config.model)
    item = make(next(fresh))
    template = TextPrompt(prompt=prompt, multi_modal_data={modality: item})

    def with_dict() -> Any:
        return _render(renderer, {"prompt": prompt, "multi_modal_data": {modality: item}})

    def with_record() -> Any:
        return _render(renderer, to_vllm(scope_to_replica(template, 0, hasher=hasher)))

    for path in (with_dict, with_record):
        path()  # first use: processed and cached under this path's key
        result = path()
        assert result["mm_kwargs"][modality][0] is None, "a reuse must hit the processor cache"
    t = compare({"dict": with_dict, "record": with_record}, repeat=4 if quick else 12, warmup=1)
    ratio = speedup(t["dict"], t["record"])
    judged = nbytes >= 16 * MB
    return [
        Row(
            "frontend",
            f"{label} ({nbytes / MB:.0f} MB), reused{', thread busy in Python' if busy else ''}: record vs dict",
            t["record"].best * 1e3,
            "ms per request",
            baseline=f"dict (vLLM hashes) {t['dict'].best * 1e3:.3g} ms",
            ratio=ratio,
            target="speed >= 20x" if judged else "",
            met=ratio >= 20 if judged else None,
            note=f"on medians {median_speedup(t['dict'], t['record']):.2f}x",
        )
    ]


def _first_use(
    renderer: Any,
    label: str,
    modality: str,
    prompt: str,
    make: Make,
    nbytes: int,
    busy: bool,
    quick: bool,
    fresh: Iterator[int],
) -> list[Row]:
    from omni_requests_vllm import to_vllm

    hasher = MediaHasher(renderer.model_config.model)
    dicts, records = Timing(), Timing()
    clock = time.perf_counter
    # One collection before the rounds, none inside: with vLLM and torch loaded a full
    # collection takes most of a second.
    with no_gc():
        for round_ in range(2 if quick else 5):
            for path in ("dict", "record") if round_ % 2 else ("record", "dict"):
                item = make(next(fresh))  # never seen: the processor runs
                start = clock()
                if path == "dict":
                    result = _render(renderer, {"prompt": prompt, "multi_modal_data": {modality: item}})
                else:
                    record = TextPrompt(prompt=prompt, multi_modal_data={modality: item})
                    result = _render(renderer, to_vllm(scope_to_replica(record, 0, hasher=hasher)))
                elapsed = clock() - start
                assert result["mm_kwargs"][modality][0] is not None, "a first use must be processed"
                (dicts if path == "dict" else records).samples.append(elapsed)
                del item, result
    ratio = records.best / dicts.best
    return [
        Row(
            "frontend",
            f"{label} ({nbytes / MB:.0f} MB), first use{', thread busy in Python' if busy else ''}: record vs dict",
            records.best * 1e3,
            "ms per request",
            baseline=f"dict {dicts.best * 1e3:.4g} ms",
            ratio=ratio,
            target="time <= 1.05x",
            met=ratio <= 1.05,
            note=f"time ratio; on medians {records.median / dicts.median:.2f}x; the record's copy and key included",
        )
    ]
