"""Comparable pictures of engine dicts and keys, the same in every process."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import numpy as np

from omni_requests import EncoderDecoderPrompt, MediaHasher, media_keys
from omni_requests_vllm import to_vllm

HASHER = MediaHasher("/models/wire")


def plain(value: Any) -> Any:
    """``value`` with arrays, tensors and images as their bytes, every type and order kept."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.tobytes())
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(value.dtype), tuple(value.shape), raw)
    image_module = sys.modules.get("PIL.Image")
    if image_module is not None and isinstance(value, image_module.Image):
        palette = value.palette
        colors = None if palette is None else (palette.mode, palette.rawmode, bytes(palette.palette))
        exif = sorted((k, repr(v)) for k, v in value.getexif().items())
        return (
            "image",
            value.mode,
            value.size,
            value.tobytes(),
            colors,
            value.info.get("transparency"),
            exif,
        )
    if isinstance(value, dict):
        return ("dict", [(k, plain(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [plain(v) for v in value])
    if isinstance(value, float):
        return ("float", np.array(value).tobytes())
    return (type(value).__name__, value)


def picture(record: Any) -> dict[str, Any]:
    """What must be identical on both sides: the engine dict (as a digest), every key, the order."""
    engine = to_vllm(record)
    parts = (
        [record.encoder_prompt, record.decoder_prompt]
        if isinstance(record, EncoderDecoderPrompt)
        else [record]
    )
    keys = []
    for part in parts:
        if part is None:
            keys.append(None)
            continue
        rows = media_keys(part, HASHER if part.scope is None else None)
        keys.append({m: [None if k is None else k.render() for k in row] for m, row in rows.items()})
    single = parts[0]
    return {
        "engine": hashlib.sha256(repr(plain(engine)).encode()).hexdigest(),
        "keys": keys,
        "order": list(engine.get("multi_modal_data", {}))
        if not isinstance(record, EncoderDecoderPrompt)
        else list(to_vllm(single).get("multi_modal_data", {})),
        "uuid_order": list(to_vllm(single).get("multi_modal_uuids") or {}),
        "kind": type(record).__name__,
    }
