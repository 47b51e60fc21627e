"""``MediaHasher.key`` is vLLM's ``MultiModalHasher.hash_kwargs``, bit for bit.

For every kind of media ``omni_requests.strategies`` makes (PIL images in every mode,
with palettes and EXIF ``ImageID`` tags; numpy arrays of every dtype and memory layout,
0-d included; tensors, bfloat16 and non-contiguous ones included; videos as arrays,
frame lists, PIL frame lists and ``(frames, metadata)``; audio as ``(waveform, rate)``,
arrays and float lists) and for nested values, under each of the three algorithms
and random model ids:

    MediaHasher(model_id, algorithm).key(modality, item)
        == MultiModalHasher.hash_kwargs(algorithm, model_id=model_id, **{modality: item})

on the item as given, and on the record's frozen copy of it
(``TextPrompt(...).multi_modal_data[modality][0]``, the item given as a one-item ``pvector``: read-only arrays, ``PVector`` lists,
``FrozenDict`` maps) against vLLM's hash of the item as given; and vLLM's hash of what ``to_vllm`` sends for
the record is that same key. A second call on the frozen copy (served from the key
cache for read-only arrays) must agree too.
"""

from __future__ import annotations

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import collections
import io
import logging
import math
import pickle
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image
from pyrsistent import pmap, pvector
from vllm.multimodal.hasher import MultiModalHasher

from omni_requests import InvalidPromptError, MediaHasher, PromptTypeError, TextPrompt, _image_road
from omni_requests.strategies import (
    HASH_ALGORITHMS,
    IMAGE_MODES,
    arrays,
    audios,
    hashers,
    images,
    media_items,
    tensors,
    videos,
)
from omni_requests_vllm import to_vllm

pytestmark = pytest.mark.vllm

EXAMPLES = 500
"""Per media kind; each example draws its own algorithm and model id."""

PARITY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True, scope="module")
def _quiet_pickle_fallback() -> Iterator[None]:
    # vLLM logs a warning each time it pickles a value it has no rule for (numpy
    # scalars in nested values): thousands of lines, all expected here.
    logger = logging.getLogger("vllm.multimodal.hasher")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _vllm_key(hasher: MediaHasher, modality: str, item: object) -> str:
    return MultiModalHasher.hash_kwargs(hasher.algorithm, model_id=hasher.model_id, **{modality: item})


def _in_a_record(modality: str, item: object) -> tuple[object, object]:
    """The record's frozen copy of ``item``, and what ``to_vllm`` hands vLLM for it.

    The item goes in as the one item of a ``pvector`` (a record's own list of items, not
    split again), with a UUID so that a ``None`` item is allowed too.
    """
    record = TextPrompt(
        prompt="x", multi_modal_data={modality: pvector([item])}, multi_modal_uuids={modality: ["u"]}
    )
    (frozen,) = record.multi_modal_data[modality]
    (sent,) = to_vllm(record)["multi_modal_data"][modality]
    return frozen, sent


def _vllm_cannot_parse(image: Image.Image) -> bool:
    from vllm.multimodal.image import convert_image_mode, normalize_image

    try:
        convert_image_mode(normalize_image(image.copy()), "RGB")
    except Exception:  # noqa: BLE001 - whatever Pillow raises in vLLM's parser
        return True
    return False


def _is_number(item: object) -> bool:
    return isinstance(item, (int, float, np.number, np.bool_)) or getattr(item, "ndim", None) == 0


def _number_frames(video: object) -> bool:
    frames = video[0] if isinstance(video, tuple) and len(video) == 2 else video
    return _is_number(frames) or (isinstance(frames, list) and any(_is_number(frame) for frame in frames))


def assert_parity(hasher: MediaHasher, modality: str, item: object) -> None:
    try:
        expected = _vllm_key(hasher, modality, item)
    except Exception as error:  # noqa: BLE001 - whatever vLLM raises, we must raise too
        # vLLM cannot hash a few values (a bfloat16 tensor whose one element has a
        # stride != 1, e.g. torch.zeros(2, dtype=torch.bfloat16)[::2]): no key exists.
        with pytest.raises(type(error)):
            hasher.key(modality, item)
        return
    assert hasher.key(modality, item) == expected
    if modality == "video" and (isinstance(item, Image.Image) or getattr(item, "ndim", None) == 3):
        # Records refuse a lone image or 3-D array as a video item: the engine's dict would
        # carry it in a list, which vLLM reads as the frames of one video (test_records.py).
        with pytest.raises(PromptTypeError, match="video"):
            _in_a_record(modality, item)
        return
    if modality in ("image", "video", "audio") and _is_number(item):
        # Records refuse a number (a 0-d array or tensor too) as an audio item: the
        # engine's dict carries items in a list, which vLLM reads as one waveform of
        # samples; and as an image or video item, which vLLM's processing fails on
        # (test_trust.py).
        with pytest.raises(PromptTypeError, match=modality):
            _in_a_record(modality, item)
        return
    if modality == "video" and _number_frames(item):
        # Nor a video whose frames are a number, or a list of frames holding one.
        with pytest.raises(PromptTypeError, match="not a video"):
            _in_a_record(modality, item)
        return
    if (
        modality == "audio"
        and isinstance(item, tuple)
        and (len(item) != 2 or isinstance(item[0], (str, bytes, memoryview)) or _is_number(item[0]))
    ):
        # Records refuse an audio tuple vLLM cannot unpack as (waveform, rate), or whose
        # waveform is text, bytes or a number (test_records.py); its hasher still keys it.
        with pytest.raises(PromptTypeError, match=r"audio item|not a waveform"):
            _in_a_record(modality, item)
        return
    if _unshaped(modality, item):
        # Records refuse an image or video of too few dimensions, a video frame that is
        # not 3-D, a dict or image as audio, and a waveform in (waveform, rate) that is no
        # array, tensor or sequence of samples: vLLM's parser or the model's processor
        # fails on each (test_records.py).
        with pytest.raises(
            (PromptTypeError, InvalidPromptError),
            match=r"is not (an image|a video|a waveform|an audio item)|has no pixels|of no frames|no samples|empty",
        ):
            _in_a_record(modality, item)
        return
    if _not_samples(modality, item):
        # Records refuse an audio waveform of no numbers: an array of text, dates or
        # records, or a list vLLM cannot make an array of numbers of (ragged or mixed
        # channels); a rate it may also carry can be refused first (test_records.py).
        with pytest.raises(
            (PromptTypeError, InvalidPromptError),
            match=r"is not a sample|empty list of samples|no samples|beside|a sample rate must be",
        ):
            _in_a_record(modality, item)
        return
    if modality == "audio" and isinstance(item, tuple) and _not_a_rate(item[1]):
        # Records refuse a rate vLLM cannot resample from, or reads by accident (a str, a
        # bool: test_records.py); its hasher keys it.
        with pytest.raises((PromptTypeError, InvalidPromptError), match="a sample rate must be"):
            _in_a_record(modality, item)
        return
    if modality in ("video", "audio") and _no_content(item):
        # Records refuse a video without pixels or frames, an audio without samples: the
        # model's processor fails on it (test_records.py); vLLM's hasher keys it.
        with pytest.raises(InvalidPromptError, match=r"has no pixels|of no frames|no samples|empty list"):
            _in_a_record(modality, item)
        return
    if isinstance(item, (str, bytes, memoryview)) and modality in ("image", "video", "audio"):
        # Records refuse a str or bytes as an image, video or audio item: vLLM's renderer
        # refuses it or reads its characters as items (test_records.py); its hasher keys it.
        with pytest.raises(PromptTypeError, match=r"(a str is|raw bytes .*are) not"):
            _in_a_record(modality, item)
        return
    if modality == "image" and isinstance(item, Image.Image) and _vllm_cannot_parse(item):
        # Records refuse an image vLLM's parser cannot turn into RGB ("La"; test_renderer.py).
        with pytest.raises(InvalidPromptError, match="cannot turn"):
            _in_a_record(modality, item)
        return
    if modality == "image" and _no_image(item):
        # Records refuse a container, or an image without pixels, as an image item: the
        # model's processor fails on it (test_records.py); vLLM's hasher keys it.
        with pytest.raises((PromptTypeError, InvalidPromptError), match=r"is not an image|has no pixels"):
            _in_a_record(modality, item)
        return
    frozen, sent = _in_a_record(modality, item)
    assert hasher.key(modality, frozen) == expected
    assert hasher.key(modality, frozen) == expected  # again: cached where the bytes are frozen
    assert _vllm_key(hasher, modality, sent) == expected  # vLLM on the record's dict


def _unshaped(modality: str, item: object) -> bool:
    """Whether records refuse ``item`` for its dimensions or kind (see assert_parity)."""

    def too_few(value: object) -> bool:  # a 2-D tensor is an embedding item to vLLM's parser
        return (isinstance(value, np.ndarray) and value.ndim < 3) or (
            isinstance(value, torch.Tensor) and value.ndim < 2
        )

    def dims(value: object) -> int | None:
        return value.ndim if isinstance(value, (np.ndarray, torch.Tensor)) else None

    # Too many: an image or video item of more than 4 (the model's processor fails), an
    # audio item or waveform of more than 2 (vLLM's audio normalisation fails).
    if modality in ("image", "video") and (too_few(item) or (dims(item) or 0) > 4):
        return True
    if modality == "video":
        frames = item[0] if isinstance(item, tuple) and len(item) == 2 else item
        if frames is not item and dims(frames) not in (None, 3, 4):  # (frames, metadata)
            return True
        if frames is not item and not (item[1] is None or isinstance(item[1], Mapping)):  # type: ignore[index]
            return True  # vLLM types the metadata a dict: a pair of frames is no video
        return isinstance(frames, list) and any(
            isinstance(frame, (np.ndarray, torch.Tensor)) and frame.ndim != 3 for frame in frames
        )
    if modality == "audio":
        if isinstance(item, (dict, Image.Image)):
            return True
        waveform = item[0] if isinstance(item, tuple) and len(item) == 2 else item
        if (dims(waveform) or 0) > 2:
            return True
        # A list or tuple of samples is the model's feature extractor's to read (kept).
        return (
            isinstance(item, tuple)
            and len(item) == 2
            and not isinstance(item[0], (np.ndarray, torch.Tensor, list, tuple))
        )
    return False


def _not_samples(modality: str, item: object) -> bool:
    """Whether records refuse an audio item for what its waveform holds (see assert_parity):
    an array of no numbers, or a list vLLM's parser cannot make a 1-D or 2-D array of
    numbers of (it calls np.array on it)."""
    if modality != "audio":
        return False
    main = item[0] if isinstance(item, tuple) and len(item) == 2 else item
    if isinstance(main, np.ndarray):
        return main.dtype.kind in "USMmVO"
    if not isinstance(main, (list, tuple)):
        return False
    try:
        array = np.array(main)
    except (ValueError, TypeError, RuntimeError):  # ragged, or what numpy cannot read
        return True
    return array.dtype.kind in "USMmVO" or array.ndim not in (1, 2) or array.size == 0


def _no_content(item: object) -> bool:
    """Whether a video or audio item (or the first of its pair) is empty, or has a frame
    with a side of 0."""
    main = item[0] if isinstance(item, tuple) and len(item) == 2 else item
    if isinstance(main, (np.ndarray, torch.Tensor)):
        return 0 in tuple(main.shape)
    if isinstance(main, list):
        return not main or any(
            0 in (frame.size if isinstance(frame, Image.Image) else tuple(frame.shape))
            for frame in main
            if isinstance(frame, (Image.Image, np.ndarray, torch.Tensor))
        )
    return False


def _no_image(item: object) -> bool:
    """Whether an image item is a dict, a list or tuple holding no image, array or tensor,
    or an image without pixels."""
    if isinstance(item, Image.Image):
        return 0 in item.size
    if isinstance(item, (np.ndarray, torch.Tensor)):
        return 0 in tuple(item.shape)
    return isinstance(item, dict) or (isinstance(item, (list, tuple)) and not _holds_media(item))


def _holds_media(value: object) -> bool:
    if isinstance(value, (Image.Image, np.ndarray, torch.Tensor)):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_media(v) for v in value)
    return isinstance(value, dict) and any(_holds_media(v) for v in value.values())


def _not_a_rate(rate: object) -> bool:
    """Whether an audio tuple's rate is neither None nor a finite number that rounds to 1
    or more (vLLM's resamplers read ``int(round(rate))``)."""
    if rate is None:
        return False
    if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, (int, float, np.integer, np.floating)):
        return True
    return not (0 < float(rate) < math.inf and round(float(rate)) >= 1)


modalities = st.sampled_from(("image", "video", "audio"))


@PARITY
@given(hasher=hashers(), image=images(max_side=6))
def test_images_every_mode_palette_and_exif_image_id(hasher: MediaHasher, image: Any) -> None:
    assert_parity(hasher, "image", image)


@pytest.mark.parametrize("mode", IMAGE_MODES)
@settings(max_examples=10, deadline=None)
@given(hasher=hashers(), data=st.data())
def test_images_of_each_mode(mode: str, hasher: MediaHasher, data: st.DataObject) -> None:
    assert_parity(hasher, "image", data.draw(images(modes=[mode], max_side=5)))


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_large_rgb_images_packed_while_a_helper_thread_hashes(algorithm: str) -> None:
    # At 4 MiB of pixels and up, RGB images take their own road (see _rgb_overlapped).
    height, width = 1401, 2001
    assert height * width * 3 >= _image_road._OVERLAPPED_BYTES
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8))
    hasher = MediaHasher("m", algorithm)  # type: ignore[arg-type]
    assert hasher.key("image", image) == _vllm_key(hasher, "image", image)
    assert hasher.content_key("image", image) == _vllm_key(hasher, "image", image)


@PARITY
@given(hasher=hashers(), modality=modalities, array=arrays(max_dims=4, max_side=5))
def test_arrays_every_dtype_and_layout(hasher: MediaHasher, modality: str, array: np.ndarray) -> None:
    assert_parity(hasher, modality, array)


@PARITY
@given(hasher=hashers(), modality=modalities, tensor=tensors(max_dims=3, max_side=5), grad=st.booleans())
def test_tensors_bfloat16_and_non_contiguous(
    hasher: MediaHasher, modality: str, tensor: Any, grad: bool
) -> None:
    if grad and tensor.is_floating_point():
        tensor = tensor.detach().clone().requires_grad_()
    assert_parity(hasher, modality, tensor)


@PARITY
@given(hasher=hashers(), video=videos(max_frames=3, max_side=4))
def test_videos_arrays_frame_lists_and_metadata(hasher: MediaHasher, video: Any) -> None:
    assert_parity(hasher, "video", video)


@PARITY
@given(hasher=hashers(), audio=audios(max_samples=16))
def test_audio_tuples_arrays_and_lists(hasher: MediaHasher, audio: Any) -> None:
    assert_parity(hasher, "audio", audio)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hasher=hashers(), modality=modalities, data=st.data())
def test_media_items_as_the_strategies_mix_them(
    hasher: MediaHasher, modality: str, data: st.DataObject
) -> None:
    assert_parity(hasher, modality, data.draw(media_items(modality, embeddings=True)))


# Nested values: what an item may hold besides media (metadata dicts, tuples, scalars).
# Ints stay within int64: vLLM hashes a larger int through np.array(obj), an object
# array whose bytes are the int's address, so equal big ints get different keys.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | hnp.from_dtype(np.dtype("float32"))
    | hnp.from_dtype(np.dtype("int16"))
)
_leaves = _scalars | arrays(max_dims=3, max_side=3) | tensors(max_dims=2, max_side=3) | images(max_side=3)
_keys = st.text(min_size=1, max_size=5)
nested = st.recursive(
    _leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(_keys, children, max_size=3)
    ),
    max_leaves=8,
)


@PARITY
# "caption": a custom modality, whose str items records take as they are.
@given(hasher=hashers(), modality=modalities | st.just("caption"), value=nested)
def test_nested_values(hasher: MediaHasher, modality: str, value: object) -> None:
    assert_parity(hasher, modality, value)


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_digest_lengths_follow_the_algorithm(algorithm: str) -> None:
    hasher = MediaHasher("m", algorithm)  # type: ignore[arg-type]
    key = hasher.key("image", np.zeros((2, 2, 3), np.uint8))
    assert len(key) == {"blake3": 64, "sha256": 64, "sha512": 128}[algorithm]
    assert key == _vllm_key(hasher, "image", np.zeros((2, 2, 3), np.uint8))


def test_the_model_id_and_the_modality_are_part_of_the_key() -> None:
    item = torch.arange(6).reshape(2, 3)
    keys = {
        MediaHasher(model, "blake3").key(modality, item)
        for model in ("/models/a", "/models/b")
        for modality in ("image", "audio")
    }
    assert len(keys) == 4


def test_a_tensor_vllm_cannot_hash_cannot_be_keyed_either() -> None:
    # A bfloat16 tensor of one element with stride 2 counts as contiguous, so vLLM's
    # .contiguous() keeps the stride and its byte view fails. No key exists for it.
    tensor = torch.zeros(2, dtype=torch.bfloat16)[::2]
    with pytest.raises(RuntimeError, match="stride"):
        _vllm_key(MediaHasher("m"), "image", tensor)
    with pytest.raises(RuntimeError, match="stride"):
        MediaHasher("m").key("image", tensor)


def test_an_rgb_gif_frame_holding_a_palette_is_keyed_as_vllms_parser_hands_it_on() -> None:
    # Pillow reads an animated GIF's later frames as RGB with the palette still attached;
    # vLLM's parser copies the image (exif_transpose copies even where it turns nothing)
    # and Pillow's copy keeps a palette only for P and PA. The content key hashed the
    # palette, a key vLLM never computes; and the record's pickle dropped it.
    from vllm.multimodal.image import convert_image_mode, normalize_image

    rng = np.random.default_rng(1)
    frames = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).quantize(16) for _ in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    buffer.seek(0)
    gif = Image.open(buffer)
    gif.seek(1)
    gif.load()
    assert gif.mode == "RGB" and gif.palette is not None
    hasher = MediaHasher("m")
    parsed = convert_image_mode(normalize_image(gif), "RGB")
    assert hasher.content_key("image", gif) == _vllm_key(hasher, "image", parsed)
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": gif})
    copy = pickle.loads(pickle.dumps(record))
    assert copy == record
    assert hasher.content_key("image", copy.multi_modal_data["image"][0]) == _vllm_key(
        hasher, "image", parsed
    )


def _deep_list(depth: int) -> list[Any]:
    value: list[Any] = [0]
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.array([object(), object()]),
        lambda: torch.empty(2, 3, device="meta"),
        lambda: torch.eye(3).to_sparse(),
        lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        lambda: "\ud800",
        lambda: _deep_list(5000),
    ],
    ids=["object array", "meta tensor", "sparse tensor", "nested tensor", "lone surrogate", "5000 deep"],
)
def test_an_item_vllm_cannot_hash_raises_what_vllm_raises_and_a_record_refuses_it(make: Any) -> None:
    # MediaHasher's docstring: no key exists; records refuse such an item by name.
    hasher = MediaHasher("m")
    with pytest.raises(Exception) as theirs:  # whatever vLLM raises
        _vllm_key(hasher, "image", make())
    with pytest.raises(type(theirs.value)):
        hasher.key("image", make())
    with pytest.raises((PromptTypeError, InvalidPromptError)) as caught:
        TextPrompt(prompt="x", multi_modal_data={"image": [make()]})
    assert caught.value.path.startswith("$.multi_modal_data.image[0]")


@pytest.mark.parametrize(
    ("bare", "plain"),
    [
        (lambda a: pvector([a, a]), lambda a: [a, a]),
        (lambda a: collections.UserDict({"x": a}), lambda a: {"x": a}),
        (lambda a: pmap({"x": 1}), lambda a: {"x": 1}),
        (lambda a: types.MappingProxyType({"x": 1}), lambda a: {"x": 1}),
    ],
    ids=["pvector", "UserDict", "pmap", "mappingproxy"],
)
def test_a_bare_container_is_keyed_as_the_plain_one_a_record_sends(bare: Any, plain: Any) -> None:
    # docs/vllm-parity.md: vLLM's hasher pickles a container that is not a plain dict,
    # list or tuple (or cannot pickle it), so for such a bare item key differs from
    # hash_kwargs; our key is vLLM's key of the dict or list a record hands on.
    hasher = MediaHasher("m")
    array = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    ours = hasher.key("custom", bare(array))
    assert ours == hasher.key("custom", plain(array)) == _vllm_key(hasher, "custom", plain(array))
    try:
        theirs = _vllm_key(hasher, "custom", bare(array))
    except Exception:  # noqa: BLE001 - a mappingproxy: vLLM cannot pickle it, no key at all
        theirs = None
    assert theirs != ours
