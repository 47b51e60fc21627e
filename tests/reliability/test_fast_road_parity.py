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
from omni_requests import _image_road as road

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
MODES = sorted(road._STREAMED_MODES)
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
    monkeypatch.setattr(road, "ENABLED", False)  # the switch: Pillow's own copying road
    assert hasher.key("image", image) == streamed


@pytest.mark.parametrize("size", [(40, 30), LARGE], ids=str)
def test_an_unfamiliar_pillow_takes_the_copying_road(
    size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _image("RGB", size)
    assert road._streamed_pixels(image) is not None

    def missing(*_: object) -> None:
        raise OSError("encoder raw not available")

    monkeypatch.setattr(Image, "_getencoder", missing)
    monkeypatch.setattr(road, "_band_packing_works", lambda: False)
    assert road._streamed_pixels(image) is None


def test_a_packing_surprise_raises_instead_of_returning_a_wrong_key(monkeypatch: pytest.MonkeyPatch) -> None:
    def short(image: Any) -> Any:
        return road.Pixels("|u1", (1, 1), 5, partial(road._fed, [b"abc"]))

    monkeypatch.setattr(hashing, "pixels", short)
    with pytest.raises(RuntimeError, match="packed 3 bytes"):
        MediaHasher("/m").key("image", _image("RGB", (1, 1)))


# -- large RGB images: packed on the calling thread while a helper thread hashes --


def _copying_road_key(hasher: MediaHasher, image: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """The key through Pillow's own ``tobytes()``: the bytes vLLM hashes, no packer of ours."""
    with monkeypatch.context() as patch:
        patch.setattr(road, "ENABLED", False)
        return hasher.key("image", image)


@pytest.fixture
def no_gil_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that never moves: no step looks like a wait for the GIL, so a loaded machine
    cannot switch the image to the one-piece road and change how many steps a test counts."""
    monkeypatch.setattr(road, "_clock", lambda: 0.0)
    monkeypatch.setattr(road, "_contended_until", 0.0)


@pytest.fixture
def overlapped(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The images that took the helper-thread road."""
    return record_calls(monkeypatch, road, "_rgb_overlapped", 0)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("size", [LARGE, (70_001, 41)], ids=str)  # then a line longer than a chunk
def test_large_rgb_images_hash_like_the_copying_road(
    algorithm: Any, size: tuple[int, int], overlapped: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert size[0] * size[1] * 3 >= road._OVERLAPPED_BYTES
    hasher = MediaHasher("/m", algorithm)
    image = _image("RGB", size)
    key = hasher.key("image", image)
    assert overlapped == [image]
    assert key == _copying_road_key(hasher, image, monkeypatch)


def test_overlapping_stores_pack_rgbx_as_pillow_packs_rgb() -> None:
    image = _image("RGB", (7, 5))
    out = np.zeros(7 * 5 * 3 + 1, np.uint8)
    road._pack_rgbx(out, np.frombuffer(image.tobytes("raw", "RGBX"), np.uint32))
    assert out[:-1].tobytes() == image.tobytes()
    assert road._band_packing_works()


@pytest.mark.parametrize("rows", [1, 4, 5, 13])  # 13 lines: bands of 4 end with one line
def test_pasted_bands_hold_the_images_lines_in_order(rows: int) -> None:
    image = _image("RGB", (37, 13))
    lines = np.asarray(image)
    top = 0
    for band in road._pasted_bands(image, rows):
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
        monkeypatch.setattr(road, "_pack_rgbx", lambda out, pixels: out.fill(0))
    elif surprise == "Pillow copies the band":  # the band no longer shares the numpy buffer
        frombuffer = Image.frombuffer
        monkeypatch.setattr(Image, "frombuffer", lambda *args: frombuffer(*args).copy())
    else:
        monkeypatch.delattr(Image, "frombuffer")
    road._band_packing_works.cache_clear()
    try:
        assert not road._band_packing_works()
        assert hasher.key("image", image) == expected
    finally:
        road._band_packing_works.cache_clear()
    assert overlapped == []


@pytest.mark.usefixtures("no_gil_waits")
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
        road.pixels(image).feed(update)
    assert len(seen) == 3  # nothing hashed after the failure
    assert road._HELPERS.wait_idle(timeout=30)
    assert len(seen) == 3  # nor by a helper still busy after the call returned
    hasher = MediaHasher("/m")  # and the helpers serve the next image as before
    assert hasher.key("image", image) == _copying_road_key(hasher, image, monkeypatch)


@pytest.mark.usefixtures("no_gil_waits")
def test_a_failure_while_packing_reaches_the_caller_and_stops_the_hashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = _image("RGB", LARGE)
    packed: list[int] = []
    real = road._pack_rgbx

    def failing(out: Any, pixels: Any) -> None:
        if len(packed) == 5:
            raise MemoryError("no room")
        packed.append(len(pixels))
        real(out, pixels)

    fed: list[int] = []
    with monkeypatch.context() as patch:
        patch.setattr(road, "_pack_rgbx", failing)
        with pytest.raises(MemoryError, match="no room"):
            road.pixels(image).feed(lambda chunk: fed.append(len(chunk)))
    count = len(fed)
    assert road._HELPERS.wait_idle(timeout=30)
    assert len(fed) == count  # the helper was done with this image when the call ended
    hasher = MediaHasher("/m")
    assert hasher.key("image", image) == _copying_road_key(hasher, image, monkeypatch)


def test_with_every_helper_busy_the_packing_thread_hashes_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    hasher = MediaHasher("/m")
    image = _image("RGB", LARGE)
    monkeypatch.setattr(road._HELPERS, "run", lambda work: None)
    assert hasher.key("image", image) == _copying_road_key(hasher, image, monkeypatch)


def test_helpers_are_few_and_keep_nothing_alive() -> None:
    image = _image("RGB", LARGE)

    class Digest:
        def update(self, chunk: Any) -> None:
            pass

    digest = Digest()
    gone = weakref.ref(digest)
    road.pixels(image).feed(digest.update)
    del digest
    assert gone() is None  # the helper let go of the work before its caller woke
    assert 1 <= road._HELPERS.count().started <= len(os.sched_getaffinity(0))
    assert "omni-requests hashing" in {t.name for t in threading.enumerate()}


def test_a_caller_that_waited_for_its_helper_finds_it_free_again() -> None:
    # Back-to-back images from one thread should always get the kept helper: the helper
    # must be listed idle again before its caller wakes. While this thread holds the
    # helpers' lock the helper cannot list itself, so its caller must not wake either.
    helpers = road._Helpers(limit=1)
    for _ in range(3):
        finished = helpers.run(lambda: None)
        assert finished is not None
        with helpers._lock:
            assert not finished.wait(timeout=0.2)  # a wake-up here would come too early
        finished.wait()
        assert helpers.count() == (1, 1)


# -- another thread busy in Python: each release of the GIL may cost a switch interval (5 ms) --


class _Clock:
    """The roads' clock, made to jump: a step that "took" a second looks like it waited for the GIL."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def jump(self) -> None:
        self.now += 1.0


class _Recorder:
    """A digest's ``update`` that records each chunk's size and hashes the chunks with blake3."""

    def __init__(self, clock: _Clock | None = None, slow_at: int = 0) -> None:
        self.sizes: list[int] = []
        self.digest = blake3()
        self._clock = clock
        self._slow_at = slow_at

    def update(self, chunk: Any) -> None:
        self.sizes.append(len(chunk))
        self.digest.update(chunk)
        if self._clock is not None and len(self.sizes) == self._slow_at:
            self._clock.jump()  # as long as getting the GIL back can take


def _slow_band(monkeypatch: pytest.MonkeyPatch, at: int) -> tuple[list[object], _Clock]:
    """Record the bands packed, and make packing band ``at`` look as if it waited for the GIL."""
    packed = record_calls(monkeypatch, road, "_pack_rgbx", 1)
    real = road._pack_rgbx
    clock = _Clock()

    def slow_at(out: Any, pixels: Any) -> None:
        real(out, pixels)
        if len(packed) == at:
            clock.jump()

    monkeypatch.setattr(road, "_pack_rgbx", slow_at)
    monkeypatch.setattr(road, "_clock", clock)
    return packed, clock


def test_after_a_slow_update_the_rest_of_an_image_is_hashed_in_one_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = _image("RGB", (1200, 1000))  # below 4 MiB: packed by Pillow a chunk at a time
    nbytes = 1200 * 1000 * 3
    assert nbytes < road._OVERLAPPED_BYTES
    chunks = [len(c) for c in road._packed(image, Image._getencoder("RGB", "raw", "RGB"), nbytes)]
    assert len(chunks) > 10
    clock = _Clock()
    monkeypatch.setattr(road, "_clock", clock)
    slow = _Recorder(clock, slow_at=2)
    assert road.pixels(image).feed(slow.update) == nbytes
    *first, rest = slow.sizes
    assert len(first) == 2  # the second update ended the chunks
    assert first == chunks[: len(first)] and rest == nbytes - sum(first)
    assert slow.digest.hexdigest() == blake3(image.tobytes()).hexdigest()


@pytest.mark.parametrize("helped", [True, False], ids=["helper", "no helper"])
def test_after_a_slow_band_the_rest_of_a_large_image_is_hashed_in_one_piece(
    helped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _image("RGB", LARGE)
    assert road._band_packing_works()  # checked now, so only the image's bands are counted
    if not helped:
        monkeypatch.setattr(road._HELPERS, "run", lambda work: None)
    _slow_band(monkeypatch, 3)
    recorder = _Recorder()
    assert road.pixels(image).feed(recorder.update) == 2001 * 1401 * 3
    *bands, rest = recorder.sizes
    assert len(bands) == 3  # the third band ended the bands
    assert len(set(bands)) == 1 and rest > bands[0]
    assert recorder.digest.hexdigest() == blake3(image.tobytes()).hexdigest()


def test_after_a_wait_for_the_gil_images_take_the_one_piece_road_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = _image("RGB", LARGE)
    nbytes = 2001 * 1401 * 3
    expected = blake3(image.tobytes()).hexdigest()
    assert road._band_packing_works()  # checked now, so only the image's bands are counted
    packed, clock = _slow_band(monkeypatch, 1)
    first = _Recorder()
    assert road.pixels(image).feed(first.update) == nbytes
    assert len(first.sizes) == 2  # one band, then the rest in one piece
    until = road._contended_until
    assert until == clock.now + road._CONTENDED_FOR

    # Within _CONTENDED_FOR: Pillow's one-piece road, one update, no bands packed.
    bands_before = len(packed)
    clock.now += road._CONTENDED_FOR / 2
    contended = _Recorder(clock, slow_at=1)  # its one update looks slow too: not a wait
    assert road.pixels(image).feed(contended.update) == nbytes
    assert contended.sizes == [nbytes] and len(packed) == bands_before
    assert contended.digest.hexdigest() == expected
    assert road._contended_until == until  # one piece taking long is no wait: not renewed

    # Later (the one-piece road did not renew the time): the fast road again.
    clock.now += road._CONTENDED_FOR
    later = _Recorder()
    assert road.pixels(image).feed(later.update) == nbytes
    assert len(later.sizes) > 2 and len(packed) > bands_before
    assert later.digest.hexdigest() == expected


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


def test_the_switch_turns_the_road_off_with_the_same_keys() -> None:
    # OMNI_REQUESTS_NO_IMAGE_ROAD, read at import: Pillow's own copy, no helper threads.
    import subprocess
    import sys

    code = (
        "import threading, numpy as np; from PIL import Image;"
        "from omni_requests import MediaHasher, _image_road as road;"
        "image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (1401, 2001, 3), np.uint8));"
        "print(road.ENABLED, MediaHasher('/m').key('image', image),"
        " any(t.name == 'omni-requests hashing' for t in threading.enumerate()))"
    )
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (1401, 2001, 3), np.uint8))
    expected = MediaHasher("/m").key("image", image)
    env = {**os.environ, "OMNI_REQUESTS_NO_IMAGE_ROAD": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", expected, "False"]


class _SlowPart:
    """A digest (blake3 underneath) that records each update's size, and makes the
    ``slow``-th large update look as if it waited for the GIL (0: none)."""

    def __init__(self, clock: _Clock, slow: int) -> None:
        self.sizes: list[int] = []
        self.large = 0
        self.contended_after = False
        self._digest = blake3()
        self._clock = clock
        self._slow = slow

    def update(self, chunk: Any) -> None:
        size = memoryview(chunk).nbytes
        self.sizes.append(size)
        self._digest.update(chunk)
        if size >= hashing._TIMED_PART_BYTES:
            self.large += 1
            if self.large == self._slow:
                self._clock.jump()

    def hexdigest(self) -> str:
        return str(self._digest.hexdigest())


def _hash_frames(monkeypatch: pytest.MonkeyPatch, slow: int, contended: bool) -> tuple[str, _SlowPart]:
    """The key of eight 600 KB frames as a list, through a recording digest."""
    frames = [np.random.default_rng(n).integers(0, 256, (400, 500, 3), dtype=np.uint8) for n in range(8)]
    clock = _Clock()
    monkeypatch.setattr(road, "_clock", clock)
    monkeypatch.setattr(road, "_contended_until", 1.0 if contended else 0.0)
    monkeypatch.setattr(hashing, "_TIMED_PART_BYTES", 500_000)  # each frame is timed
    digest = _SlowPart(clock, slow)
    monkeypatch.setattr(MediaHasher, "_new_hasher", lambda self, nbytes: digest)
    key = MediaHasher("m").key("video", frames)
    digest.contended_after = road.contended()
    monkeypatch.undo()
    assert key == MediaHasher("m").key("video", frames)  # the same digest whatever the feeding
    return key, digest


def test_a_multi_part_item_is_fed_a_part_at_a_time_while_no_part_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, digest = _hash_frames(monkeypatch, slow=0, contended=False)
    assert digest.large == 8 and len(digest.sizes) > 8


def test_after_a_slow_part_the_rest_of_a_multi_part_item_is_hashed_in_one_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Beside a thread busy in Python each update can wait a switch interval for the GIL;
    # after one did, the rest (five frames and their framing) is one update.
    _, digest = _hash_frames(monkeypatch, slow=3, contended=False)
    third = [i for i, size in enumerate(digest.sizes) if size == 400 * 500 * 3][2]
    (rest,) = digest.sizes[third + 1 :]
    assert digest.large == 4 and rest > 5 * 400 * 500 * 3
    assert digest.contended_after  # and the next items and images take their one-piece roads


def test_while_the_gil_is_contended_a_multi_part_item_is_one_update(monkeypatch: pytest.MonkeyPatch) -> None:
    _, digest = _hash_frames(monkeypatch, slow=0, contended=True)
    assert len(digest.sizes) == 1 and digest.sizes[0] > 8 * 400 * 500 * 3


def test_what_is_gathered_is_hashed_whenever_a_bounded_amount_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_GATHERED_MAX", 2 * 400 * 500 * 3)
    _, digest = _hash_frames(monkeypatch, slow=0, contended=True)
    assert len(digest.sizes) == 4 and all(size >= 2 * 400 * 500 * 3 for size in digest.sizes)


def test_a_part_as_large_as_the_bound_is_fed_as_it_is_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_GATHERED_MAX", 400 * 500 * 3)  # each frame reaches it
    _, digest = _hash_frames(monkeypatch, slow=0, contended=True)
    assert digest.sizes.count(400 * 500 * 3) == 8  # every frame on its own, framing between


def test_gathering_refuses_a_buffer_blake3_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    # blake3 takes bytes only: a float32 memoryview raises fed directly, as in vLLM's
    # hasher, and must raise the same while parts are gathered (bytearray would take it).
    item = [np.zeros((600, 600, 3), np.uint8), memoryview(np.zeros(300_000, np.float32))]
    for contended in (False, True):
        monkeypatch.setattr(road, "_contended_until", road._clock() + (100.0 if contended else -100.0))
        with pytest.raises(BufferError):
            MediaHasher("m").key("video", item)


def test_gathering_refuses_a_scalar_byte_view_as_blake3_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 0-d uint8 view has byte format and is contiguous, yet blake3 refuses it ("shape is
    # null"); gathered into a bytearray it would be taken and the busy road would key it.
    item = [np.zeros((1000, 1000, 3), np.uint8), memoryview(np.array(7, np.uint8))]  # gathered: 3 MB
    for contended in (False, True):
        monkeypatch.setattr(road, "_contended_until", road._clock() + (100.0 if contended else -100.0))
        with pytest.raises(BufferError):
            MediaHasher("m").key("video", item)
