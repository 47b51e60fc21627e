"""The fast hashing roads give the digests of the slow ones, and of vLLM, bit for bit.

Three shortcuts in MediaHasher: plain contiguous arrays reuse their framing bytes, PIL
images are packed and hashed a chunk at a time instead of through one image-sized
``bytes`` (vLLM's ``np.asarray(image)``), and large RGB images are packed by numpy while
a helper thread hashes. Each is checked against our own copying road (always) and
against vLLM's MultiModalHasher (tests marked ``vllm``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
import weakref
from functools import partial
from typing import Any

import numpy as np
import pytest
from blake3 import blake3
from PIL import Image

from omni_requests import MediaHasher
from omni_requests import _hashing as hashing

from ..conftest import record_calls

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
LARGE = (2001, 1401)  # 8.4 MB of RGB pixels: packed while a helper thread hashes


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


@pytest.mark.parametrize("size", [(40, 30), LARGE], ids=str)
def test_an_unfamiliar_pillow_takes_the_copying_road(
    size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _image("RGB", size)
    assert hashing._streamed_pixels(image) is not None

    def missing(*_: object) -> None:
        raise OSError("encoder raw not available")

    monkeypatch.setattr(Image, "_getencoder", missing)
    monkeypatch.setattr(hashing, "_band_packing_works", lambda: False)
    assert hashing._streamed_pixels(image) is None


def test_a_packing_surprise_raises_instead_of_returning_a_wrong_key(monkeypatch: pytest.MonkeyPatch) -> None:
    def short(image: Any) -> Any:
        return "|u1", (1, 1), 5, partial(hashing._fed, [b"abc"])

    monkeypatch.setattr(hashing, "_pixels", short)
    with pytest.raises(RuntimeError, match="packed 3 bytes"):
        MediaHasher("/m").key("image", _image("RGB", (1, 1)))


# -- large RGB images: packed on the calling thread while a helper thread hashes --


def _copying_road_key(hasher: MediaHasher, image: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """The key through Pillow's own ``tobytes()``: the bytes vLLM hashes, no packer of ours."""
    with monkeypatch.context() as patch:
        patch.setattr(hashing, "_STREAMED_MODES", frozenset())
        return hasher.key("image", image)


@pytest.fixture
def overlapped(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The images that took the helper-thread road."""
    return record_calls(monkeypatch, hashing, "_rgb_overlapped", 0)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("size", [LARGE, (70_001, 41)], ids=str)  # then a line longer than a chunk
def test_large_rgb_images_hash_like_the_copying_road(
    algorithm: Any, size: tuple[int, int], overlapped: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert size[0] * size[1] * 3 >= hashing._OVERLAPPED_BYTES
    hasher = MediaHasher("/m", algorithm)
    image = _image("RGB", size)
    key = hasher.key("image", image)
    assert overlapped == [image]
    assert key == _copying_road_key(hasher, image, monkeypatch)


def test_overlapping_stores_pack_rgbx_as_pillow_packs_rgb() -> None:
    image = _image("RGB", (7, 5))
    out = np.zeros(7 * 5 * 3 + 1, np.uint8)
    hashing._pack_rgbx(out, np.frombuffer(image.tobytes("raw", "RGBX"), np.uint32))
    assert out[:-1].tobytes() == image.tobytes()
    assert hashing._band_packing_works()


@pytest.mark.parametrize("rows", [1, 4, 5, 13])  # 13 lines: bands of 4 end with one line
def test_pasted_bands_hold_the_images_lines_in_order(rows: int) -> None:
    image = _image("RGB", (37, 13))
    lines = np.asarray(image)
    top = 0
    for band in hashing._pasted_bands(image, rows):
        count = len(band) // 37
        assert count == min(rows, 13 - top)
        rgb = band.view(np.uint8).reshape(count, 37, 4)[..., :3]
        assert np.array_equal(rgb, lines[top : top + count])
        top += count
    assert top == 13


@pytest.mark.parametrize(
    "surprise", ["numpy stores out of order", "Pillow copies the band", "Pillow refuses"]
)
def test_where_band_packing_would_differ_pillows_packer_is_used(
    surprise: str, overlapped: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    hasher = MediaHasher("/m")
    image = _image("RGB", LARGE)
    expected = _copying_road_key(hasher, image, monkeypatch)
    if surprise == "numpy stores out of order":
        monkeypatch.setattr(hashing, "_pack_rgbx", lambda out, pixels: out.fill(0))
    elif surprise == "Pillow copies the band":  # the band no longer shares the numpy buffer
        frombuffer = Image.frombuffer
        monkeypatch.setattr(Image, "frombuffer", lambda *args: frombuffer(*args).copy())
    else:
        monkeypatch.delattr(Image, "frombuffer")
    hashing._band_packing_works.cache_clear()
    try:
        assert not hashing._band_packing_works()
        assert hasher.key("image", image) == expected
    finally:
        hashing._band_packing_works.cache_clear()
    assert overlapped == []


def test_a_failing_digest_update_reaches_the_caller_and_stops_the_hashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = _image("RGB", LARGE)
    seen: list[int] = []

    def update(chunk: Any) -> None:
        seen.append(len(chunk))
        if len(seen) == 3:
            raise OSError("digest failed")

    with pytest.raises(OSError, match="digest failed"):
        hashing._pixels(image)[3](update)
    time.sleep(0.05)
    assert len(seen) == 3  # nothing hashed after the failure, nor after the call returned
    hasher = MediaHasher("/m")  # and the helpers serve the next image as before
    assert hasher.key("image", image) == _copying_road_key(hasher, image, monkeypatch)


def test_a_failure_while_packing_reaches_the_caller_and_stops_the_hashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = _image("RGB", LARGE)
    packed: list[int] = []
    real = hashing._pack_rgbx

    def failing(out: Any, pixels: Any) -> None:
        if len(packed) == 5:
            raise MemoryError("no room")
        packed.append(len(pixels))
        real(out, pixels)

    fed: list[int] = []
    with monkeypatch.context() as patch:
        patch.setattr(hashing, "_pack_rgbx", failing)
        with pytest.raises(MemoryError, match="no room"):
            hashing._pixels(image)[3](lambda chunk: fed.append(len(chunk)))
    count = len(fed)
    time.sleep(0.05)
    assert len(fed) == count  # the helper was done with this image when the call ended
    hasher = MediaHasher("/m")
    assert hasher.key("image", image) == _copying_road_key(hasher, image, monkeypatch)


def test_with_every_helper_busy_the_packing_thread_hashes_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    hasher = MediaHasher("/m")
    image = _image("RGB", LARGE)
    monkeypatch.setattr(hashing._HELPERS, "run", lambda work: None)
    assert hasher.key("image", image) == _copying_road_key(hasher, image, monkeypatch)


def test_helpers_are_few_and_keep_nothing_alive() -> None:
    image = _image("RGB", LARGE)

    class Digest:
        def update(self, chunk: Any) -> None:
            pass

    digest = Digest()
    gone = weakref.ref(digest)
    hashing._pixels(image)[3](digest.update)
    del digest
    assert gone() is None  # the helper let go of the work before its caller woke
    assert 1 <= hashing._HELPERS._started <= len(os.sched_getaffinity(0))
    assert "omni-requests hashing" in {t.name for t in threading.enumerate()}


def test_a_caller_that_waited_for_its_helper_finds_it_free_again() -> None:
    # Back-to-back images from one thread should always get the kept helper: the helper
    # must be idle again before its caller wakes. Slowing the helper's way back to idle
    # makes a caller that woke too early find no helper.
    helpers = hashing._Helpers(limit=1)
    caller = threading.current_thread()
    real = helpers._lock

    class SlowForHelpers:
        def __enter__(self) -> None:
            if threading.current_thread() is not caller:
                time.sleep(0.02)
            real.acquire()

        def __exit__(self, *exc: object) -> None:
            real.release()

    helpers._lock = SlowForHelpers()  # type: ignore[assignment]
    for _ in range(5):
        finished = helpers.run(lambda: None)
        assert finished is not None
        finished.wait()


# -- another thread busy in Python: each release of the GIL may cost a switch interval (5 ms) --


class _Recorder:
    """A digest's ``update`` that records each chunk's size and hashes the chunks with blake3."""

    def __init__(self, slow_at: int = 0) -> None:
        self.sizes: list[int] = []
        self.digest = blake3()
        self._slow_at = slow_at

    def update(self, chunk: Any) -> None:
        self.sizes.append(len(chunk))
        self.digest.update(chunk)
        if len(self.sizes) == self._slow_at:
            time.sleep(0.01)  # as long as getting the GIL back can take


def test_after_a_slow_update_the_rest_of_an_image_is_hashed_in_one_piece() -> None:
    image = _image("RGB", (1200, 1000))  # below 4 MiB: packed by Pillow a chunk at a time
    nbytes = 1200 * 1000 * 3
    assert nbytes < hashing._OVERLAPPED_BYTES
    chunks = [len(c) for c in hashing._packed(image, Image._getencoder("RGB", "raw", "RGB"), nbytes)]
    assert len(chunks) > 10
    slow = _Recorder(slow_at=2)
    assert hashing._pixels(image)[3](slow.update) == nbytes
    *first, rest = slow.sizes
    assert 1 <= len(first) <= 2  # the second update at the latest ended the chunks
    assert first == chunks[: len(first)] and rest == nbytes - sum(first)
    assert slow.digest.hexdigest() == blake3(image.tobytes()).hexdigest()


@pytest.mark.parametrize("helped", [True, False], ids=["helper", "no helper"])
def test_after_a_slow_band_the_rest_of_a_large_image_is_hashed_in_one_piece(
    helped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _image("RGB", LARGE)
    assert hashing._band_packing_works()  # checked now, so only the image's bands are counted
    if not helped:
        monkeypatch.setattr(hashing._HELPERS, "run", lambda work: None)
    packed = record_calls(monkeypatch, hashing, "_pack_rgbx", 1)
    real = hashing._pack_rgbx

    def slow_third(out: Any, pixels: Any) -> None:
        real(out, pixels)
        if len(packed) == 3:
            time.sleep(0.01)

    monkeypatch.setattr(hashing, "_pack_rgbx", slow_third)
    recorder = _Recorder()
    assert hashing._pixels(image)[3](recorder.update) == 2001 * 1401 * 3
    *bands, rest = recorder.sizes
    assert 1 <= len(bands) <= 3  # the third band at the latest ended the bands
    assert len(set(bands)) == 1 and rest > bands[0]
    assert recorder.digest.hexdigest() == blake3(image.tobytes()).hexdigest()


def _key_in_a_child(queue: Any) -> None:
    queue.put(MediaHasher("/m").key("image", _image("RGB", LARGE)))


def test_a_forked_child_hashes_without_its_parents_helpers() -> None:
    hasher = MediaHasher("/m")
    image = _image("RGB", LARGE)
    expected = hasher.key("image", image)  # the parent's helpers exist now
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_key_in_a_child, args=(results,))
    child.start()
    child.join(timeout=20)
    if child.is_alive():
        child.kill()
        pytest.fail("the child hung: it waited for a helper that only exists in its parent")
    assert results.get(timeout=5) == expected


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
