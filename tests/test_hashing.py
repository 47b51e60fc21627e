"""MediaHasher without vLLM: the framed stream, layouts, caching and argument checks.

Bit-for-bit parity with vLLM's own hasher is proven in tests/vllm/test_hash_parity.py.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from blake3 import blake3

from omni_requests import InvalidPromptError, MediaHasher, PromptTypeError, TextPrompt, _hashing

from .conftest import record_calls, video


def _framed(chunk: bytes) -> bytes:
    return len(chunk).to_bytes(8, "little") + chunk


def _leaf_int(value: int) -> bytes:
    return b"\x03" + _framed(np.array(value).tobytes())


def test_stream_matches_the_documented_framing() -> None:
    """Written from vLLM's framing rules by hand, independently of the implementation."""
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    stream = (
        _framed(b"image")  # kwargs sorted by name: "image" < "model_id"
        + b"\x03"
        + _framed(b"ndarray")
        + b"\x02"
        + (3).to_bytes(8, "little")
        + _framed(b"dtype")
        + b"\x03"
        + _framed(b"|u1")
        + _framed(b"shape")
        + b"\x01"
        + (3).to_bytes(8, "little")
        + _leaf_int(2)
        + _leaf_int(2)
        + _leaf_int(3)
        + _framed(b"data")
        + b"\x03"
        + _framed(image.tobytes())
        + _framed(b"model_id")
        + b"\x03"
        + _framed(b"m")
    )
    assert MediaHasher("m").key("image", image) == blake3(stream).hexdigest()


def test_non_contiguous_arrays_hash_like_their_contiguous_copy(hasher: MediaHasher) -> None:
    frames = video(3, frames=5)
    strided = frames[::2, :, ::-1]
    assert not strided.flags.c_contiguous
    assert hasher.key("video", strided) == hasher.key("video", np.ascontiguousarray(strided))


def test_large_non_contiguous_arrays_stream_in_blocks(
    hasher: MediaHasher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_hashing, "_BLOCK_BYTES", 64)  # force many blocks on a small array
    frames = video(4, frames=9)[:, ::2]
    assert hasher.key("video", frames) == hasher.key("video", np.ascontiguousarray(frames))


def test_parallel_blake3_gives_the_same_digest(hasher: MediaHasher, monkeypatch: pytest.MonkeyPatch) -> None:
    frames = video(5)
    serial = hasher.key("video", frames)
    monkeypatch.setattr(_hashing, "_PARALLEL_BYTES", 1)
    assert hasher.key("video", frames.copy()) == serial


def test_algorithms_give_their_own_digests() -> None:
    item = video(6)
    keys = {alg: MediaHasher("m", alg).key("video", item) for alg in ("blake3", "sha256", "sha512")}
    assert len(set(keys.values())) == 3
    assert [len(k) for k in keys.values()] == [64, 64, 128]


def test_model_id_and_modality_are_part_of_the_key() -> None:
    item = video(7)
    assert MediaHasher("a").key("video", item) != MediaHasher("b").key("video", item)
    assert MediaHasher("a").key("video", item) != MediaHasher("a").key("image", item)


def test_dtype_and_shape_are_part_of_the_key(hasher: MediaHasher) -> None:
    raw = np.zeros(12, np.uint8)
    assert hasher.key("image", raw) != hasher.key("image", raw.reshape(3, 4))
    assert hasher.key("image", raw) != hasher.key("image", raw.view(np.int8))


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Records every real digest computation (cache misses)."""
    return record_calls(monkeypatch, MediaHasher, "_digest", 2)


def test_record_items_are_hashed_once(hasher: MediaHasher, digests: list[object]) -> None:
    frames = video(8)
    prompt = TextPrompt(prompt="x", multi_modal_data={"video": [frames, (frames, {"fps": 1.0})]})
    items = prompt.multi_modal_data["video"]
    first = [hasher.key("video", item) for item in items]
    again = [hasher.key("video", item) for item in items for _ in range(5)]
    assert again == [k for k in first for _ in range(5)]
    assert len(digests) == 2


def test_arrays_someone_can_make_writable_are_rehashed(hasher: MediaHasher, digests: list[object]) -> None:
    frames = video(9)
    frames.flags.writeable = False  # read-only now, but its owner can turn that back
    before = hasher.key("video", frames)
    frames.flags.writeable = True
    frames[0, 0, 0, 0] ^= 0xFF
    frames.flags.writeable = False
    after = hasher.key("video", frames)
    assert before != after, "a key must follow the bytes it stands for"
    assert len(digests) == 2


def test_cache_entries_go_with_their_arrays(hasher: MediaHasher) -> None:
    # A record's own array: the one kind of array whose key is cached.
    frames = TextPrompt(prompt="x", multi_modal_data={"video": video(10)}).multi_modal_data["video"][0]
    gc.collect()  # earlier tests' cyclic garbage goes now, not during the count below
    size = len(_hashing._CACHE)
    hasher.key("video", frames)
    assert len(_hashing._CACHE) == size + 1
    del frames
    gc.collect()
    assert len(_hashing._CACHE) == size


def test_a_live_array_beside_ever_new_scalars_keeps_a_bounded_number_of_keys(hasher: MediaHasher) -> None:
    # Each key names the scalars beside an array too (an audio's rate): a server keeping a
    # decoded clip alive grew the cache by one entry per distinct rate a client chose,
    # without end (found by a review, helper-87: 40,000 entries for 20,000 requests).
    wave = TextPrompt(prompt="x", multi_modal_data={"audio": np.zeros(16, np.float32)}).multi_modal_data[
        "audio"
    ][0]
    gc.collect()
    size = len(_hashing._CACHE)
    keys = [hasher.content_key("audio", (wave, 16_000 + i)) for i in range(300)]
    assert size < len(_hashing._CACHE) <= size + _hashing._KEYS_PER_OBJECT
    assert len(set(keys)) == 300
    # The oldest were let go; asked again they are computed again, the same.
    assert (
        hasher.content_key("audio", (wave, 16_000))
        == keys[0]
        == hasher.content_key("audio", (wave.copy(), 16_000))
    )


@pytest.mark.parametrize(
    ("args", "error", "path"),
    [
        (("",), InvalidPromptError, "$.model_id"),
        ((3,), PromptTypeError, "$.model_id"),
        (("m", "md5"), InvalidPromptError, "$.algorithm"),
    ],
)
def test_bad_hasher_arguments(args: tuple[object, ...], error: type[Exception], path: str) -> None:
    with pytest.raises(error) as caught:
        MediaHasher(*args)  # type: ignore[arg-type]
    assert caught.value.path == path  # type: ignore[attr-defined]


def test_an_int_beyond_64_bits_has_no_key(hasher: MediaHasher) -> None:
    # numpy holds it as an object, whose bytes are a memory address (vLLM's hasher hashes
    # them): equal values got two keys, and a reused address repeated one. Records refuse it.
    assert hasher.key("video", [2**64 - 1]) != hasher.key("video", [2**64 - 2])  # uint64: still a number
    for number in (2**64, -(2**63) - 1, 10**30):
        for key in (hasher.key, hasher.content_key, hasher.fingerprint):
            with pytest.raises(ValueError, match=f"^{number} does not fit in 64 bits"):
                key("audio", [number])


def test_model_id_is_not_a_modality(hasher: MediaHasher) -> None:
    with pytest.raises(InvalidPromptError, match="not a modality"):
        hasher.key("model_id", video(1))


def test_content_key_hashes_images_as_vllms_parser_makes_them(hasher: MediaHasher) -> None:
    from PIL import Image

    pixels = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    upright = Image.fromarray(pixels).convert("P")
    turned = upright.copy()
    turned.getexif()[0x0112] = 6  # EXIF Orientation: rotate 90 degrees when shown
    assert hasher.key("image", upright) == hasher.key("image", turned), "the raw key cannot see it"
    assert hasher.content_key("image", upright) != hasher.content_key("image", turned)
    assert hasher.content_key("image", upright) == hasher.key("image", upright.convert("RGB"))
    rgb = Image.fromarray(pixels)
    assert hasher.content_key("image", rgb) == hasher.key("image", rgb)
    # Other modalities and items are hashed as given.
    assert hasher.content_key("video", pixels) == hasher.key("video", pixels)


def test_keys_of_tuples_and_a_records_item_lists_of_its_arrays_are_computed_once() -> None:
    # MediaHasher's docstring: a tuple or a record's own item list of a record's arrays
    # cannot change, so its key is cached; a plain list can (its holder may append or
    # swap), so it is hashed at every call.
    from collections import Counter

    from .conftest import CountingHasher

    hasher = CountingHasher("m")
    frames = np.zeros((4, 4, 3), np.uint8), np.ones((4, 4, 3), np.uint8)
    record = TextPrompt(prompt="x", multi_modal_data={"video": [list(frames)]})
    own = record.multi_modal_data["video"][0]  # the record's own list of its frames
    # A dict in a tuple can change too: (frames, metadata) is hashed at every call.
    for item, digests in ((own, 1), (tuple(own), 1), (list(own), 2), ((own[0], {"fps": 1.0}), 2)):
        CountingHasher.computed = Counter()
        assert hasher.key("video", item) == hasher.key("video", item)
        assert sum(CountingHasher.computed.values()) == digests, item


def test_a_hasher_subclass_is_never_served_the_base_classes_cached_keys() -> None:
    # Keys of a record's arrays are cached across hashers of one model and algorithm; a
    # subclass that computes its own digests must get its own, not the base class's.
    class Salted(MediaHasher):
        def _digest(self, modality: str, item: object, *leaf: Any) -> str:
            return "salted-" + super()._digest(modality, item, *leaf)

    record = TextPrompt(prompt="<image>", multi_modal_data={"image": np.zeros((4, 4, 3), np.uint8)})
    (image,) = record.multi_modal_data["image"]
    base = MediaHasher("m").key("image", image)
    assert Salted("m").key("image", image) == f"salted-{base}"
    assert MediaHasher("m").key("image", image) == base
