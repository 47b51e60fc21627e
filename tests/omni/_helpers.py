"""Small real media built in memory, deep comparison, and a model of vLLM's processor caches."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from PIL import Image

from omni_requests_vllm import to_vllm


class IndexedAs(list[Any]):
    """A caller's list that iterates what it holds but answers ``[i]`` (how vLLM reads a
    UUID row) from ``indexed``."""

    def __init__(self, held: list[Any], indexed: list[Any]) -> None:
        super().__init__(held)
        self.indexed = indexed

    def __getitem__(self, i: Any) -> Any:
        return self.indexed[i] if isinstance(i, int) else super().__getitem__(i)


class FirstReadAs(list[Any]):
    """A caller's list whose first iteration (a check's) gives ``first``, and every later
    one (vLLM's) what it holds."""

    def __init__(self, first: list[Any], held: list[Any]) -> None:
        super().__init__(held)
        self.first: list[Any] | None = first

    def __iter__(self) -> Iterator[Any]:
        first, self.first = self.first, None
        return iter(first) if first is not None else super().__iter__()


def image_array(seed: int, side: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def video_array(seed: int, frames: int = 3, side: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, side, side, 3), dtype=np.uint8)


def png_bytes(seed: int, side: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image_array(seed, side)).save(buffer, format="PNG")
    return buffer.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def wav_bytes(samples: np.ndarray, rate: int = 16000, *, width: int = 2, channels: int = 1) -> bytes:
    """PCM WAV of integer ``samples`` (already in the sample width's range, interleaved)."""
    dtype = {1: "<u1", 2: "<i2", 4: "<i4"}[width]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(width)
        wav.setframerate(rate)
        wav.writeframes(np.asarray(samples).astype(dtype).tobytes())
    return buffer.getvalue()


def tone(seed: int, n: int = 400) -> np.ndarray:
    """Random 16-bit samples, distinct per seed."""
    return np.random.default_rng(seed).integers(-(1 << 15), 1 << 15, n, dtype=np.int64)


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def deep_equal(a: Any, b: Any) -> bool:
    """Structural equality that compares arrays and images by content and type."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
        )
    if isinstance(a, Image.Image):
        return isinstance(b, Image.Image) and (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
    if isinstance(a, Mapping):
        return (
            type(a) is type(b) and list(a.keys()) == list(b.keys()) and all(deep_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(deep_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def containers(value: Any) -> dict[int, Any]:
    """Every mutable container (dict, list) reachable from ``value``, by identity."""
    found: dict[int, Any] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found[id(item)] = item
            stack.extend(item.values())
        elif isinstance(item, list):
            found[id(item)] = item
            stack.extend(item)
        elif isinstance(item, tuple):
            stack.extend(item)
    return found


def uuids_of(prompt: Any) -> dict[str, list[str | None]]:
    """The ``multi_modal_uuids`` the engine gets for a dict or a record."""
    out = prompt if isinstance(prompt, dict) else to_vllm(prompt)
    return out.get("multi_modal_uuids") or {}


class ProcessorCaches:
    """vLLM's processor caches with several stage-0 replicas, as design.md §2 describes.

    One *sender* cache in the frontend process, one *receiver* cache per replica. On a
    sender hit the frontend omits the item's data and the replica fills it from its own
    receiver cache; a miss there is the bug (a crash, or another request's features).
    """

    def __init__(self) -> None:
        self.sender: set[str] = set()
        self.receivers: dict[int, dict[str, Any]] = {}
        self.misses: list[tuple[int, str]] = []

    def send(self, replica: int, key: str, item: Any) -> Any:
        """The item replica ``replica`` ends up with for ``key``."""
        receiver = self.receivers.setdefault(replica, {})
        if key in self.sender:  # data omitted on the wire
            if key not in receiver:
                self.misses.append((replica, key))
                return None
            return receiver[key]
        self.sender.add(key)
        receiver[key] = item
        return item
