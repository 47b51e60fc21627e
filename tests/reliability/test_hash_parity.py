"""The fast hashing roads give the digests of the slow ones, and of vLLM, bit for bit.

Two shortcuts in MediaHasher: plain contiguous arrays reuse their framing bytes, and
PIL images are packed and hashed a chunk at a time instead of through one image-sized
``bytes`` (vLLM's ``np.asarray(image)``). Each is checked against our own generic road
(always) and against vLLM's MultiModalHasher (tests marked ``vllm``).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omni_requests import MediaHasher
from omni_requests import _hashing as hashing

DTYPES = [
    "uint8",
    "int8",
    ">i2",
    "<u4",
    "int64",
    "float16",
    ">f4",
    "float64",
    "bool",
    "complex128",
    "<U2",
    "V3",
    "M8[s]",
]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4), (0, 3), (1, 1, 1, 1)]
MODES = sorted(hashing._STREAMED_MODES)
SIZES = [(1, 1), (5, 3), (0, 4), (4, 0), (257, 129), (3000, 90)]


class _Sub(np.ndarray):  # type: ignore[type-arg]
    """An ndarray subclass: not a plain array, so it takes the generic road."""


def _array(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    raw = np.random.default_rng(len(shape)).integers(
        0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8
    )
    if dt.kind == "U":
        raw = np.frombuffer(b"".join(b"a\x00\x00\x00" for _ in range(len(raw) // 4)), np.uint8)
    return raw.view(dt).reshape(shape)


def _image(mode: str, size: tuple[int, int]) -> Image.Image:
    width, height = size
    pixels = np.random.default_rng(width * 7 + height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels) if width and height else Image.new("RGB", size)
    if mode in ("I;16", "I;16L", "I;16B", "I;16N"):
        return image.convert("I").convert(mode) if width and height else Image.new(mode, size)
    if mode == "P":
        return image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return image.convert(mode)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_plain_arrays_hash_like_the_generic_road(dtype: str, shape: tuple[int, ...]) -> None:
    hasher = MediaHasher("/m", "sha256" if dtype == "bool" else "blake3")
    array = _array(dtype, shape)
    assert array.flags.c_contiguous
    assert hasher.key("video", array) == hasher.key("video", array.view(_Sub))


def test_frames_are_cached_per_shape_and_not_mixed_up() -> None:
    hasher = MediaHasher("/m")
    a, b = np.zeros((2, 3), np.uint8), np.zeros((3, 2), np.uint8)
    assert hasher.key("image", a) != hasher.key("image", b)
    assert hasher.key("image", a) != MediaHasher("/other").key("image", a)
    assert hasher.key("image", a) != hasher.key("video", a)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_streamed_images_hash_like_the_copying_road(
    mode: str, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    hasher = MediaHasher("/m")
    image = _image(mode, size)
    streamed = hasher.key("image", image)
    monkeypatch.setattr(hashing, "_STREAMED_MODES", frozenset())
    assert hasher.key("image", image) == streamed


def test_an_unfamiliar_pillow_takes_the_copying_road(monkeypatch: pytest.MonkeyPatch) -> None:
    image = _image("RGB", (40, 30))
    assert hashing._streamed_pixels(image) is not None

    def missing(*_: object) -> None:
        raise OSError("encoder raw not available")

    monkeypatch.setattr(Image, "_getencoder", missing)
    assert hashing._streamed_pixels(image) is None


def test_a_packing_surprise_raises_instead_of_returning_a_wrong_key(monkeypatch: pytest.MonkeyPatch) -> None:
    def short(image: Any) -> Any:
        return "|u1", (1, 1), 5, [b"abc"]

    monkeypatch.setattr(hashing, "_pixels", short)
    with pytest.raises(RuntimeError, match="packed 3 bytes"):
        MediaHasher("/m").key("image", _image("RGB", (1, 1)))


# -- against vLLM itself --


@pytest.fixture(scope="module")
def vllm_key() -> Any:
    hasher = pytest.importorskip("vllm.multimodal.hasher")

    def key(algorithm: str, modality: str, item: object) -> str:
        digest: str = hasher.MultiModalHasher.hash_kwargs(algorithm, model_id="/m", **{modality: item})
        return digest

    return key


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d not in ("<U2", "V3", "M8[s]")])
def test_arrays_match_vllm(vllm_key: Any, dtype: str) -> None:
    for shape in SHAPES:
        array = _array(dtype, shape)
        for item in (array, array[::-1] if array.ndim else array):
            assert MediaHasher("/m").key("image", item) == vllm_key("blake3", "image", item)


@pytest.mark.vllm
@pytest.mark.parametrize("mode", MODES)
def test_images_match_vllm(vllm_key: Any, mode: str) -> None:
    for size in SIZES:
        image = _image(mode, size)
        for algorithm in ("blake3", "sha256"):
            assert MediaHasher("/m", algorithm).key("image", image) == vllm_key(algorithm, "image", image)


@pytest.mark.vllm
def test_a_4k_image_and_other_media_match_vllm(vllm_key: Any) -> None:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (2160, 3840, 3), dtype=np.uint8))
    with_id = _image("RGB", (8, 8))
    with_id.getexif()[0x800D] = uuid.UUID(int=7)  # EXIF ImageID: vLLM keys the image by it
    assert hashing._exif_image_id(with_id) == uuid.UUID(int=7).bytes
    frames = [rng.integers(0, 256, (72, 128, 3), dtype=np.uint8) for _ in range(4)]
    audio = rng.standard_normal(16_000).astype(np.float32)
    for modality, item in [
        ("image", image),
        ("image", with_id),
        ("video", frames),
        ("video", np.stack(frames)),
        ("audio", audio),
        ("audio", (audio, 16_000)),
        ("image", rng.integers(0, 256, 9 << 20, dtype=np.uint8)),  # above the threaded size
    ]:
        for algorithm in ("blake3", "sha512"):
            assert MediaHasher("/m", algorithm).key(modality, item) == vllm_key(algorithm, modality, item)
