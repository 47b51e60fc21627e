"""Records: what they accept, how they freeze it, and the errors for what they refuse."""

from __future__ import annotations

import array
import contextlib
import dataclasses
import io
import pickle
import re
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
from PIL import Image, ImageOps, ImagePalette
from PIL.TiffImagePlugin import IFDRational
from pyrsistent import PMap, PVector, pvector

from omni_requests import (
    EmbedsPrompt,
    EncoderDecoderPrompt,
    FrozenDict,
    InvalidPromptError,
    MediaHasher,
    OmniRequestsError,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
    media_keys,
    rendered_uuids,
    scope_to_replica,
    wire,
)
from omni_requests._embedding_fields import EmbeddingFields  # private: made by the chat path
from omni_requests._hashing import vllm_turn
from omni_requests_vllm import from_vllm, to_vllm

from .conftest import video


def test_plain_values_become_persistent_collections() -> None:
    p = TextPrompt(
        prompt="<image>",
        multi_modal_data={"image": [np.zeros((2, 2, 3), np.uint8)]},
        multi_modal_uuids={"image": ["a"]},
        mm_processor_kwargs={"size": {"h": 2}},
    )
    assert isinstance(p.multi_modal_data, PMap)
    assert isinstance(p.multi_modal_data["image"], PVector)
    assert p.multi_modal_uuids["image"] == pvector(["a"])
    assert isinstance(p.mm_processor_kwargs, FrozenDict)
    assert isinstance(p.mm_processor_kwargs["size"], FrozenDict)


def test_single_item_and_bare_string_uuid_equal_the_list_forms() -> None:
    image = np.zeros((2, 2, 3), np.uint8)
    single = TextPrompt(prompt="x", multi_modal_data={"image": image}, multi_modal_uuids={"image": "u"})
    listed = TextPrompt(prompt="x", multi_modal_data={"image": [image]}, multi_modal_uuids={"image": ["u"]})
    assert single == listed


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
def test_a_dict_of_embedding_fields_for_a_whole_modality_is_refused(modality: str) -> None:
    # vLLM splits such a dict into items by the model's own rules; a record holds a list
    # of items and would hand the engine [dict], another input.
    fields = {f"{modality}_embeds": np.zeros((4, 8), np.float32), "image_grid_thw": np.array([[1, 2, 2]])}
    with pytest.raises(PromptTypeError, match="embedding fields") as caught:
        TextPrompt(prompt="x", multi_modal_data={modality: fields})
    assert caught.value.path == f"$.multi_modal_data.{modality}"
    # A modality vLLM has no dict form for keeps a mapping as one item, as before.
    kept = TextPrompt(prompt="x", multi_modal_data={"motion": fields})
    assert len(kept.multi_modal_data["motion"]) == 1


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (Image.new("RGB", (2, 2)), "$.multi_modal_data.video[0]"),  # vLLM's parser fails on it
        ([[Image.new("RGB", (2, 2))], Image.new("RGB", (2, 2))], "$.multi_modal_data.video[1]"),
        (pvector([Image.new("RGB", (2, 2))]), "$.multi_modal_data.video[0]"),  # read back as frames
        (pvector([np.zeros((2, 2, 3), np.uint8)] * 2), "$.multi_modal_data.video"),  # the same
    ],
)
def test_items_the_engine_would_read_as_another_video_are_refused(value: object, path: str) -> None:
    with pytest.raises(PromptTypeError, match="video") as caught:
        TextPrompt(prompt="x", multi_modal_data={"video": value})
    assert caught.value.path == path
    one_frame = TextPrompt(prompt="x", multi_modal_data={"video": [Image.new("RGB", (2, 2))]})
    assert len(one_frame.multi_modal_data["video"]) == 1


@pytest.mark.parametrize(
    ("modality", "value", "count"),
    [
        ("image", np.zeros((2, 2, 3), np.uint8), 1),  # one HWC image
        ("image", np.zeros((4, 2, 2, 3), np.uint8), 4),  # a batch splits
        ("video", np.zeros((4, 2, 2, 3), np.uint8), 1),  # one THWC video
        ("video", [np.zeros((2, 2, 3), np.uint8)] * 3, 1),  # frames of one video
        ("video", [np.zeros((3, 2, 2, 3), np.uint8)] * 2, 2),  # two videos
        ("video", (np.zeros((3, 2, 2, 3), np.uint8), {"fps": 2.0}), 1),  # with metadata
        ("audio", (np.zeros(16, np.float32), 16000), 1),
        ("audio", np.zeros(16, np.float32), 1),
        ("audio", [0.1, 0.2, 0.3], 1),  # one waveform as floats
        ("audio", np.zeros((2, 16), np.float32), 2),
    ],
)
def test_items_are_counted_the_way_vllm_parses_them(modality: str, value: object, count: int) -> None:
    p = TextPrompt(prompt="x", multi_modal_data={modality: value})
    assert len(p.multi_modal_data[modality]) == count


def test_attribute_assignment_fails() -> None:
    p = TextPrompt(prompt="x")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.prompt = "y"  # type: ignore[misc]


def test_numpy_payload_is_an_immutable_copy_nobody_can_write() -> None:
    frames = video(0)
    p = TextPrompt(prompt="x", multi_modal_data={"video": frames})
    stored = p.multi_modal_data["video"][0]
    assert not np.shares_memory(stored, frames) and np.array_equal(stored, frames)
    with pytest.raises(ValueError, match="read-only"):
        stored[0, 0, 0, 0] = 1
    for handle in (stored, stored.base):  # not even through the array it views
        with pytest.raises(ValueError, match="WRITEABLE"):
            handle.flags.writeable = True
    assert frames.flags.writeable, "the caller's own array must stay as it was"


def test_a_records_own_arrays_are_shared_without_a_copy_and_a_callers_are_copied() -> None:
    # Even read-only over bytes, a caller's array may have a writable twin (test_trust.py).
    frames = np.frombuffer(video(0).tobytes(), np.uint8).reshape(video(0).shape)
    p = TextPrompt(prompt="x", multi_modal_data={"video": frames})
    own = p.multi_modal_data["video"][0]
    assert own is not frames and np.array_equal(own, frames)
    again = TextPrompt(prompt="y", multi_modal_data=p.multi_modal_data)
    assert again.multi_modal_data["video"][0] is own
    alone = TextPrompt(prompt="z", multi_modal_data={"video": [own, own]})
    assert all(item is own for item in alone.multi_modal_data["video"])
    # Unpickled or decoded, a record's arrays are the new record's own: not copied again.
    restored = pickle.loads(pickle.dumps(p)).multi_modal_data["video"][0]
    assert (
        TextPrompt(prompt="w", multi_modal_data={"video": restored}).multi_modal_data["video"][0] is restored
    )
    # numpy allows a shape set in place: the array still stands for the record's media as
    # made (which every record reads it as); a reshaped view is another array, copied.
    own.shape = (own.shape[0], -1)
    with pytest.raises(InvalidPromptError, match=r"video\[0\]: is a record's array"):
        TextPrompt(prompt="v", multi_modal_data={"video": [own]})
    assert p == TextPrompt(prompt="x", multi_modal_data={"video": frames})  # compared as made
    reshaped = p.multi_modal_data["video"][0].reshape(frames.shape[0], -1)
    copied = TextPrompt(prompt="v", multi_modal_data={"rows": [reshaped]}).multi_modal_data["rows"][0]
    assert copied is not own and copied.shape == reshaped.shape and np.array_equal(copied, reshaped)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=">i4").reshape(2, 3, 4)[:, ::-1],  # non-native order, strided
        np.ma.masked_array(np.arange(6, dtype=np.float32), mask=[0, 1, 0, 0, 1, 0]),
        np.zeros((0, 3), np.uint8),
        np.array([(1, 2.0)], dtype=[("a", "<i2"), ("b", "<f8")]),
    ],
    ids=["strided-big-endian", "masked", "empty", "structured"],
)
def test_frozen_copies_keep_dtype_shape_and_values(array: np.ndarray[Any, Any]) -> None:
    # A modality of its own: an empty array is no audio (no samples), and a record takes it here.
    stored = TextPrompt(prompt="x", multi_modal_data={"signal": [array]}).multi_modal_data["signal"][0]
    assert type(stored) is np.ndarray and stored.dtype == array.dtype and stored.shape == array.shape
    assert stored.tobytes() == np.asarray(array).tobytes() and stored.flags.c_contiguous


def test_caller_containers_are_not_changed_or_shared() -> None:
    frames = [np.zeros((2, 2, 3), np.uint8)] * 2
    data = {"video": frames}
    uuids = {"video": ["v"]}
    p = TextPrompt(prompt="x", multi_modal_data=data, multi_modal_uuids=uuids)
    frames.append(np.ones((2, 2, 3), np.uint8))
    uuids["video"][0] = "changed"
    assert len(p.multi_modal_data["video"][0]) == 2
    assert p.multi_modal_uuids["video"][0] == "v"
    assert data == {"video": frames} and uuids == {"video": ["changed"]}


def test_additional_information_cannot_reach_the_caller() -> None:
    info: dict[str, object] = {"speaker": "a", "lists": [1, 2]}
    p = TextPrompt(prompt="x", additional_information=info)
    info["global_request_id"] = "r1"
    info["lists"].append(3)  # type: ignore[attr-defined]
    assert dict(p.additional_information or {}) == {"speaker": "a", "lists": pvector([1, 2])}


def test_writable_buffers_in_options_are_copied_to_bytes() -> None:
    blob, raw = bytearray(b"abc"), bytearray(b"xyz")
    p = TextPrompt(
        prompt="x",
        mm_processor_kwargs={"blob": blob},
        additional_information={"raw": memoryview(raw), "nested": [memoryview(raw)[1:]]},
    )
    blob[0], raw[0] = ord("A"), ord("X")
    assert p.mm_processor_kwargs == {"blob": b"abc"}
    assert p.additional_information == {"raw": b"xyz", "nested": pvector([b"yz"])}
    assert pickle.loads(pickle.dumps(p)) == p  # a memoryview would not pickle


def test_structured_elements_in_options_are_owned_copies() -> None:
    # ``rows[0]`` is a view into the caller's array: a later write to the array must not
    # reach the record (media copied these already; options kept the view).
    rows = np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "<i2"), ("b", "<f8")])
    p = TextPrompt(prompt="x", mm_processor_kwargs={"row": rows[0]}, additional_information={"r": [rows[1]]})
    rows["a"] = 9
    assert p.mm_processor_kwargs is not None and p.additional_information is not None
    assert p.mm_processor_kwargs["row"].tolist() == (1, 2.0)
    assert p.additional_information["r"][0].tolist() == (3, 4.0)
    with pytest.raises(ValueError, match="read-only"):
        p.mm_processor_kwargs["row"]["a"] = 5
    assert rows.tolist() == [(9, 2.0), (9, 4.0)]  # the caller's array is its own


def test_option_values_beyond_containers_numbers_and_buffers_are_shared_as_documented() -> None:
    # docs/engine-integration.md: containers, numeric arrays and buffers are frozen; every
    # other value (a tensor, an object array, a set) is the caller's object, shared.
    torch = pytest.importorskip("torch")
    tensor, objects, tags = torch.zeros(3), np.array(["a", None], dtype=object), {"x"}
    numbers, items, image = np.zeros(3), [1], Image.new("RGB", (2, 2))
    p = TextPrompt(
        prompt="x",
        additional_information={"t": tensor, "o": objects, "s": tags, "a": numbers, "l": items, "i": image},
    )
    sent = to_vllm(p)["additional_information"]
    assert sent["t"] is tensor and sent["o"] is objects and sent["s"] is tags and sent["i"] is image
    assert sent["a"] is not numbers and not sent["a"].flags.writeable
    sent["l"].append(2)
    sent["t"].add_(1)  # a stage writing into a shared tensor in place reaches the record
    again = to_vllm(p)["additional_information"]
    assert again["l"] == [1] and items == [1] and again["t"].tolist() == [1.0, 1.0, 1.0]


def test_evolve_accepts_plain_values_and_checks_them() -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)}, multi_modal_uuids={"video": "v1"})
    q = attrs.evolve(p, multi_modal_data={"video": [video(2), video(3)]}, multi_modal_uuids=None)
    assert len(q.multi_modal_data["video"]) == 2
    with pytest.raises(InvalidPromptError, match="got 1 vs 2"):
        attrs.evolve(p, multi_modal_data={"video": [video(2), video(3)]})


def test_evolve_keeps_unchanged_media_without_rechecking() -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    q = attrs.evolve(p, prompt="y")
    assert q.multi_modal_data is p.multi_modal_data


def test_equality_compares_media_by_content() -> None:
    a = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    assert a == TextPrompt(prompt="x", multi_modal_data={"video": video(1).copy()})
    assert a != TextPrompt(prompt="x", multi_modal_data={"video": video(2)})
    assert hash(a) == hash(TextPrompt(prompt="x", multi_modal_data={"video": video(2)}))


def test_pil_images_compare_by_pixels_and_palette() -> None:
    red = Image.new("RGB", (2, 2), (255, 0, 0))
    assert TextPrompt(prompt="x", multi_modal_data={"image": red}) == TextPrompt(
        prompt="x", multi_modal_data={"image": red.copy()}
    )
    assert TextPrompt(prompt="x", multi_modal_data={"image": red}) != TextPrompt(
        prompt="x", multi_modal_data={"image": Image.new("RGB", (2, 2))}
    )


def test_palette_images_that_convert_apart_are_unequal_records() -> None:
    # The same indices and palette bytes, read as an RGB or an RGBA palette; and a palette
    # replaced on the Python side after loading, where converting to RGB reads the core's.
    # Each pair converts to other colours, so gets other keys: equal records would share.
    indices = np.arange(24, dtype=np.uint8).reshape(4, 6) % 20
    colours = bytes(range(240)) + bytes(528)

    def paletted(palette: bytes, mode: str = "RGB") -> Image.Image:
        image = Image.fromarray(indices, "P")
        image.putpalette(palette, mode)
        image.load()
        return image

    replaced = paletted(bytes(range(60)) + bytes(708))
    replaced.palette.palette = bytes(range(100, 160)) + bytes(708)
    hasher = MediaHasher("m")
    for a, b in [
        (paletted(colours, "RGB"), paletted(colours, "RGBA")),
        (replaced, paletted(bytes(range(100, 160)) + bytes(708))),
    ]:
        records = [TextPrompt(prompt="x", multi_modal_data={"image": image}) for image in (a, b)]
        assert records[0] != records[1]
        assert hasher.content_key("image", a) != hasher.content_key("image", b)
        assert records[1] == TextPrompt(prompt="x", multi_modal_data={"image": b.copy()})


def test_palette_images_whose_python_palette_is_gone_compare_by_the_cores() -> None:
    # image.palette = None: converting to RGB still reads the core's palette, so two such
    # images with other cores convert apart; and such a record crosses pickle and wire.
    indices = np.arange(12, dtype=np.uint8).reshape(3, 4)

    def bare(colours: bytes) -> Image.Image:
        image = Image.fromarray(indices, "P")
        image.putpalette(colours)
        image.load()
        image.palette = None
        return image

    a, b = bare(bytes(range(48)) * 16), bare(bytes(255 - i for i in range(48)) * 16)
    records = [TextPrompt(prompt="x", multi_modal_data={"image": image}) for image in (a, b)]
    assert records[0] != records[1]
    for back in (pickle.loads(pickle.dumps(records[0])), wire.decode(wire.encode(records[0]))):
        assert back == records[0]
        assert media_keys(back, MediaHasher("m")) == media_keys(records[0], MediaHasher("m"))


@pytest.mark.parametrize("mode", ["RGB", "L", "raw-mode", "str"])
def test_a_palette_pillow_never_makes_is_refused_by_name(mode: str) -> None:
    # Set by hand: more than 256 colours, or a palette mode no P image holds. Kept, it
    # encoded into wire bytes decode refused, or pickled into bytes pickle.loads refused.
    image = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4), "P")
    image.putpalette(bytes(range(12)))
    image.load()
    if mode == "RGB":
        image.palette = ImagePalette.ImagePalette("RGB", bytes(range(256)) * 5)
    elif mode == "L":
        image.palette.mode = "L"
    elif mode == "raw-mode":  # never read into the core: the wire decoder refused it
        image.palette = ImagePalette.ImagePalette("RGB", bytes(range(30)))
        image.palette.rawmode = "BGR"
    else:  # Pillow itself cannot read it: its TypeError escaped
        image.palette.palette = "abc"  # type: ignore[assignment]
    with pytest.raises(PromptTypeError, match=r"is none Pillow makes|cannot be read") as caught:
        TextPrompt(prompt="x", multi_modal_data={"image": [image]})
    assert caught.value.path == "$.multi_modal_data.image[0]"


def test_an_image_whose_pixels_pillow_holds_in_another_mode_is_refused_by_name() -> None:
    # An L image given a palette holds P pixels once loaded: vLLM's parser copies it (a P
    # image), the image itself is L, so its keys were none vLLM computes and its wire
    # round trip changed its key.
    image = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4), "L")
    image.palette = ImagePalette.raw("RGB", bytes(range(48)))
    with pytest.raises(PromptTypeError, match="Pillow holds its pixels as 'P'") as caught:
        TextPrompt(prompt="x", multi_modal_data={"image": [image]})
    assert caught.value.path == "$.multi_modal_data.image[0]"


def test_images_vllm_parses_apart_are_unequal_records() -> None:
    # The same pixels turned by an EXIF orientation, or with a transparency entry, give
    # the model other images and get other keys: equal records would share a cache entry.
    pixels = np.random.default_rng(0).integers(0, 256, (6, 10, 3), dtype=np.uint8)
    rotated, transparent = Image.fromarray(pixels), Image.fromarray(pixels)
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated.info["exif"] = exif.tobytes()
    transparent.info["transparency"] = tuple(int(v) for v in pixels[0, 0])
    upright = TextPrompt(prompt="x", multi_modal_data={"image": Image.fromarray(pixels)})
    hasher = MediaHasher("m")
    for image in (rotated, transparent):
        other = TextPrompt(prompt="x", multi_modal_data={"image": image})
        assert other != upright
        assert hasher.content_key("image", image) != hasher.content_key("image", Image.fromarray(pixels))
        assert other == TextPrompt(prompt="x", multi_modal_data={"image": image.copy()})


def _oriented(pixels: np.ndarray[Any, Any], orientation: object) -> TextPrompt:
    image = Image.fromarray(pixels)
    image.getexif()[0x0112] = orientation
    return TextPrompt(prompt="x", multi_modal_data={"image": image})


def test_images_vllm_parses_alike_are_equal_records() -> None:
    # Equality reads the turn vLLM's parser makes, not how the orientation is spelled: a
    # wire round trip (which sends 6.0 as 6 and 9 not at all) gives an equal record.
    pixels = np.random.default_rng(1).integers(0, 256, (6, 10, 3), dtype=np.uint8)
    six = _oriented(pixels, 6)
    assert (
        six
        == _oriented(pixels, 6.0)
        == _oriented(pixels, np.int64(6))
        == _oriented(pixels, IFDRational(6, 1))
    )
    assert six != _oriented(pixels, 8)
    upright = TextPrompt(prompt="x", multi_modal_data={"image": Image.fromarray(pixels)})
    for no_turn in (1, 9, "6", 2**64 + 6, [6]):
        assert _oriented(pixels, no_turn) == upright
    hasher = MediaHasher("m")
    assert hasher.content_key("image", _oriented(pixels, 6.0).multi_modal_data["image"][0]) == (
        hasher.content_key("image", six.multi_modal_data["image"][0])
    )
    # A transparency's type is read (5.0 fails in vLLM's convert, and records refuse it;
    # equality is stricter there than keys, docs/design.md).
    gray = Image.fromarray(pixels[..., 0])
    five, five_numpy = gray.copy(), gray.copy()
    five.info["transparency"], five_numpy.info["transparency"] = 5, np.int64(5)
    assert TextPrompt(prompt="x", multi_modal_data={"image": five}) != TextPrompt(
        prompt="x", multi_modal_data={"image": five_numpy}
    )


def test_an_image_whose_turn_fails_in_vllms_parser_equals_the_unturned_image() -> None:
    # Orientation 6 in a file's EXIF, beside an XMP entry that is no text: Pillow's
    # exif_transpose fails stripping the XMP, vLLM's parser suppresses it and keeps the
    # image unturned. Equal records must be what vLLM sees alike (they used to compare
    # equal to the turned image, with another key).
    pixels = np.random.default_rng(2).integers(0, 256, (6, 10, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    turned, unturnable = Image.fromarray(pixels), Image.fromarray(pixels)
    turned.info["exif"] = unturnable.info["exif"] = exif.tobytes()
    unturnable.info["xmp"] = 123
    records = [TextPrompt(prompt="x", multi_modal_data={"image": image}) for image in (turned, unturnable)]
    upright = TextPrompt(prompt="x", multi_modal_data={"image": Image.fromarray(pixels)})
    keys = [rendered_uuids(scope_to_replica(r, 0, hasher=MediaHasher("m"))) for r in (*records, upright)]
    assert records[0] != records[1] == upright
    assert keys[0] != keys[1] == keys[2]


@pytest.mark.parametrize(
    "xmp", [None, 123, '<x tiff:Orientation="6"/>'], ids=["no-xmp", "xmp-int", "xmp-text"]
)
@pytest.mark.parametrize(
    "mode", ["1", "L", "P", "PA", "RGB", "RGBA", "I;16", "F", "CMYK", "YCbCr", "LAB", "HSV"]
)
def test_the_turn_is_the_one_the_images_own_transpose_makes(mode: str, xmp: object) -> None:
    # vllm_turn tries the transpose on a 1x1 stand-in (the image's own costs 23 ms at
    # 4K): it must fail exactly where the image's own would.
    exif = Image.Exif()
    exif[0x0112] = 6
    image = Image.new(mode, (3, 2))
    image.info["exif"] = exif.tobytes()
    if xmp is not None:
        image.info["xmp"] = xmp
    try:
        ImageOps.exif_transpose(image.copy())
        made: int | None = 6
    except Exception:  # noqa: BLE001 - whatever Pillow raises, vLLM's parser suppresses
        made = None
    assert vllm_turn(image) == made
    assert made == (None if xmp == 123 else 6)  # both roads met


def test_repr_summarises_media() -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    assert "ndarray(uint8, 3x8x8x3)" in repr(p)
    assert len(repr(p)) < 400


def test_token_ids_accept_numpy_ints_and_store_python_ints() -> None:
    p = TokensPrompt(prompt_token_ids=np.array([1, 2, 3]))
    assert list(p.prompt_token_ids) == [1, 2, 3]
    assert all(type(t) is int for t in p.prompt_token_ids)


def test_encoder_decoder_holds_two_single_prompts() -> None:
    p = EncoderDecoderPrompt(
        encoder_prompt=TextPrompt(prompt="a"), decoder_prompt=TokensPrompt(prompt_token_ids=[1])
    )
    assert p.decoder_prompt is not None
    with pytest.raises(PromptTypeError, match=r"\$\.encoder_prompt"):
        EncoderDecoderPrompt(encoder_prompt="a")  # type: ignore[arg-type]


# -- errors: raised before anything is built, naming the field --

_IMAGE = np.zeros((2, 2, 3), np.uint8)


def test_a_waveform_given_as_a_list_is_one_vllm_can_make_an_array_of_numbers_of() -> None:
    # A list of samples (with its rate or without) is the model's to read: models without
    # target_channels (Gemma 3n, Granite Speech) take it as it is, and vLLM's parser makes
    # an array of it (np.array). What it holds must give an array of numbers: samples, or
    # channels of equal length. Whisper's feature extractor fails on text, dicts or images
    # in it, and np.array on ragged or mixed channels, after routing, naming no field
    # (found by reviews, helper-58 and helper-60).
    torch = pytest.importorskip("torch")
    wave = np.linspace(-1, 1, 10, dtype=np.float32)
    for item in (
        ([0.5, 0.25, 0.125], 16000),
        ([0.5, 0.25, 0.125], None),
        ((0.5, np.float32(0.25), 1, True), 16000),
        [0.5, 0.25, 0.125],
        list(torch.from_numpy(wave)),  # 0-d tensors
        list(wave),  # numpy scalars
        [np.float32(0.5) * np.ones(()), np.ones(())],  # 0-d arrays
        ([[0.5, 0.25], [0.0, 0.1]], 16000),  # one list per channel
        ([wave, wave * 2], 16000),  # one array per channel
        [torch.from_numpy(wave), wave.tolist()],  # a tensor and a list, one per channel
    ):
        made = TextPrompt(prompt="x", multi_modal_data={"audio": [item]})
        assert len(made.multi_modal_data["audio"]) == 1

    class Unreadable(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            raise RuntimeError("no samples here")

    for item, path, error, words in (
        ((["a", "b"], 16000), "$.multi_modal_data.audio[0][0][0]", PromptTypeError, "a str is not a sample"),
        (([None], 16000), "$.multi_modal_data.audio[0][0][0]", PromptTypeError, "a NoneType is not a sample"),
        (
            ([0.5, {"a": 1}], 16000),
            "$.multi_modal_data.audio[0][0][1]",
            PromptTypeError,
            "a dict is not a sample",
        ),
        (
            ([[0.5, [0.25]]], 16000),
            "$.multi_modal_data.audio[0][0][0][1]",
            PromptTypeError,
            "a list is not a sample",
        ),
        ([0.5, wave], "$.multi_modal_data.audio[0][1]", PromptTypeError, "a channel beside samples"),
        ([[0.1, 0.2], 0.3], "$.multi_modal_data.audio[0][1]", PromptTypeError, "a sample beside channels"),
        ([[0.1, 0.2], [0.3]], "$.multi_modal_data.audio[0][1]", InvalidPromptError, "a channel of 1 samples"),
        ([wave, wave[:4]], "$.multi_modal_data.audio[0][1]", InvalidPromptError, "a channel of 4 samples"),
        (
            [np.array(["a"]), np.array(["b"])],
            "$.multi_modal_data.audio[0][0]",
            PromptTypeError,
            "is not a sample",
        ),
        ([np.zeros((2, 2))], "$.multi_modal_data.audio[0][0]", PromptTypeError, "is not a sample"),
        # numpy cannot read these tensors (np.array fails on the list in vLLM's parser)
        (
            [torch.tensor(0.5, dtype=torch.bfloat16)],
            "$.multi_modal_data.audio[0][0]",
            PromptTypeError,
            "not a sample",
        ),
        (
            [torch.tensor(0.5, requires_grad=True)],
            "$.multi_modal_data.audio[0][0]",
            PromptTypeError,
            "not a sample",
        ),
        (([[], []], 16000), "$.multi_modal_data.audio[0][0]", InvalidPromptError, "channels of no samples"),
        (((), 16000), "$.multi_modal_data.audio[0][0]", InvalidPromptError, "an empty list of samples"),
        ((Unreadable([0.5]), 16000), "$.multi_modal_data.audio[0][0]", PromptTypeError, "cannot be read"),
    ):
        with pytest.raises(error, match=re.escape(words)) as caught:
            TextPrompt(prompt="x", multi_modal_data={"audio": [item]})
        assert caught.value.path == path


def test_audio_samples_are_numbers() -> None:
    # Records ask for numbers: a feature extractor reads numeric text, dates or a
    # one-field record array as float32 samples, and fails on other text or records
    # (helper-57 and helper-58 found both); docs/vllm-parity.md lists the divergence.
    for samples in (
        np.array(["0.5", "0.25"]),
        np.array([b"0.5", b"0.25"]),
        np.zeros(4, "M8[s]"),
        np.zeros(4, "m8[s]"),
        np.zeros(4, [("a", "<f4")]),
        np.zeros(4, [("a", "<f4"), ("b", "<i2")]),
    ):
        for item, path in (
            (samples, "$.multi_modal_data.audio[0]"),
            ((samples, 16000), "$.multi_modal_data.audio[0][0]"),
        ):
            with pytest.raises(PromptTypeError, match="holds no samples") as caught:
                TextPrompt(prompt="x", multi_modal_data={"audio": [item]})
            assert caught.value.path == path


@pytest.mark.parametrize(
    ("kwargs", "error", "path", "words"),
    [
        (
            {"multi_modal_data": {"image": [_IMAGE]}, "multi_modal_uuids": {"image": ["a", "b"]}},
            InvalidPromptError,
            "$.multi_modal_uuids.image",
            "If given, multi_modal_uuids['image'] must have same length as multi_modal_data['image'], "
            "but got 2 vs 1.",
        ),
        (
            {"multi_modal_data": {"image": [None]}},
            InvalidPromptError,
            "$.multi_modal_uuids.image[0]",
            "multi_modal_data['image'][0] is empty but multi_modal_uuids['image'][0] is missing.",
        ),
        (
            {"multi_modal_data": {"image": [_IMAGE]}, "multi_modal_uuids": {"image": [7]}},
            PromptTypeError,
            "$.multi_modal_uuids.image[0]",
            "must be a str or None, got int",
        ),
        (
            {"multi_modal_data": {"image": [_IMAGE]}, "multi_modal_uuids": {"image": [""]}},
            InvalidPromptError,
            "$.multi_modal_uuids.image[0]",
            "must not be empty",
        ),
        (
            {"multi_modal_data": {"image": [_IMAGE]}, "multi_modal_uuids": {"image": ["stage0:rep1:abc"]}},
            InvalidPromptError,
            "$.multi_modal_uuids.image[0]",
            "has been through an engine",
        ),
        ({"multi_modal_data": {"image": None}}, InvalidPromptError, "$.multi_modal_data.image", "is None"),
        ({"multi_modal_data": [_IMAGE]}, PromptTypeError, "$.multi_modal_data", "must be a mapping"),
        (
            {"multi_modal_data": {"image": [object()]}},
            PromptTypeError,
            "$.multi_modal_data.image[0]",
            "unsupported media value of type object",
        ),
        (
            {"multi_modal_data": {"image": [np.array([object()])]}},
            PromptTypeError,
            "$.multi_modal_data.image[0]",
            "dtype object",
        ),
        ({"multi_modal_data": {3: [_IMAGE]}}, PromptTypeError, "$.multi_modal_data", "must be str"),
        # What the model's processor can only fail on, after routing (tests/vllm's
        # validation-parity mutations prove vLLM refuses each too):
        (  # a gray image as a 2-D array, given whole: vLLM splits it into 1-D rows
            {"multi_modal_data": {"image": np.zeros((4, 5), np.uint8)}},
            PromptTypeError,
            "$.multi_modal_data.image[0]",
            "a 1-D numpy.ndarray is not an image (a gray one as (H, W, 1) or a PIL image); vLLM reads a 2-D",
        ),
        (
            {"multi_modal_data": {"image": [_IMAGE, np.zeros((4, 5), np.uint8)]}},
            PromptTypeError,
            "$.multi_modal_data.image[1]",
            "a 2-D numpy.ndarray is not an image",
        ),
        (
            {"multi_modal_data": {"video": np.zeros((2, 4, 5), np.uint8)}},
            PromptTypeError,
            "$.multi_modal_data.video[0]",
            "a 2-D numpy.ndarray is not a video (frames as (T, H, W, C), a gray one as (T, H, W, 1)); vLLM reads",
        ),
        (
            {"multi_modal_data": {"video": [[np.zeros((4, 5, 3), np.uint8), np.zeros((4, 5), np.uint8)]]}},
            PromptTypeError,
            "$.multi_modal_data.video[0][1]",
            "a 2-D numpy.ndarray is not a video frame",
        ),
        (
            {"multi_modal_data": {"image": [np.full((2, 2, 3), "a")]}},
            PromptTypeError,
            "$.multi_modal_data.image[0]",
            "an array of dtype <U1 holds no pixels",
        ),
        (
            {"multi_modal_data": {"audio": [(np.zeros(4, "S1"), 16000)]}},
            PromptTypeError,
            "$.multi_modal_data.audio[0][0]",
            "an array of dtype |S1 holds no samples",
        ),
        (
            {"multi_modal_data": {"audio": [np.zeros(4, np.float32), {"waveform": np.zeros(4, np.float32)}]}},
            PromptTypeError,
            "$.multi_modal_data.audio[1]",
            "a dict is not an audio item",
        ),
        (
            {"multi_modal_data": {"audio": [(None, 16000)]}},
            PromptTypeError,
            "$.multi_modal_data.audio[0][0]",
            "is not a waveform in (waveform, rate)",
        ),
        (
            {"multi_modal_data": {"audio": [({"samples": [0.5, 0.25]}, 16000)]}},
            PromptTypeError,
            "$.multi_modal_data.audio[0][0]",
            "a dict is not a waveform in (waveform, rate)",
        ),
        ({"cache_salt": 5}, PromptTypeError, "$.cache_salt", "must be a str, got int"),
        ({"mm_processor_kwargs": ["x"]}, PromptTypeError, "$.mm_processor_kwargs", "must be a mapping"),
        ({"media_io_kwargs": {"video": 3}}, PromptTypeError, "$.media_io_kwargs.video", "must be a mapping"),
        ({"prompt_embeds": [1.0]}, PromptTypeError, "$.prompt_embeds", "torch.Tensor"),
    ],
)
def test_bad_input_names_the_field(
    kwargs: dict[str, object], error: type[OmniRequestsError], path: str, words: str
) -> None:
    with pytest.raises(error) as caught:
        TextPrompt(prompt="x", **kwargs)  # type: ignore[arg-type]
    assert caught.value.path == path
    assert words in str(caught.value)


def test_errors_subclass_the_builtin_families() -> None:
    assert issubclass(InvalidPromptError, ValueError)
    assert issubclass(PromptTypeError, TypeError)


@pytest.mark.parametrize(
    ("kind", "kwargs", "path"),
    [
        (TextPrompt, {"prompt": 3}, "$.prompt"),
        (TokensPrompt, {"prompt_token_ids": "abc"}, "$.prompt_token_ids"),
        (TokensPrompt, {"prompt_token_ids": [1, True]}, "$.prompt_token_ids[1]"),
        (TokensPrompt, {"prompt_token_ids": [1, 2.5]}, "$.prompt_token_ids[1]"),
        (EmbedsPrompt, {"prompt_embeds": np.zeros((2, 2))}, "$.prompt_embeds"),
    ],
)
def test_main_field_types_are_checked(kind: type, kwargs: dict[str, object], path: str) -> None:
    with pytest.raises(PromptTypeError) as caught:
        kind(**kwargs)
    assert caught.value.path == path


@pytest.mark.parametrize(
    ("kwargs", "path", "found"),
    [
        ({"prompt_token_ids": [5, -1]}, "$.prompt_token_ids[1]", "got -1"),
        ({"prompt_token_ids": np.array([3, -2])}, "$.prompt_token_ids[1]", "got -2"),
        ({"prompt_token_ids": pvector([1 << 70])}, "$.prompt_token_ids[0]", f"got {1 << 70}"),
        ({"prompt_token_ids": [1], "token_type_ids": [0, -1]}, "$.token_type_ids[1]", "got -1"),
    ],
)
def test_token_ids_vllm_would_refuse_are_refused(kwargs: dict[str, object], path: str, found: str) -> None:
    # vLLM's renderer refuses a negative id ("out of vocabulary") and holds ids as int64.
    with pytest.raises(
        InvalidPromptError, match=rf"must be a token id between 0 and 2\*\*63 - 1.*{found}"
    ) as caught:
        TokensPrompt(**kwargs)  # type: ignore[arg-type]
    assert caught.value.path == path
    assert TokensPrompt(prompt_token_ids=[0, (1 << 63) - 1]).prompt_token_ids == pvector([0, (1 << 63) - 1])


@pytest.mark.parametrize(
    "holder",
    [bytes, bytearray, memoryview, lambda b: array.array("B", b), lambda b: array.array("b", b)],
    ids=["bytes", "bytearray", "memoryview", "array_B", "array_b"],
)
@pytest.mark.parametrize("field", ["prompt_token_ids", "token_type_ids"])
def test_raw_bytes_are_no_token_ids(holder: Callable[[bytes], object], field: str) -> None:
    # Python reads each as a sequence of ints; to a caller they are an encoded text or a
    # buffer. All were meant to be refused; all but bytes were taken.
    kwargs: dict[str, Any] = {"prompt_token_ids": [1, 2], field: holder(b"\x01\x02")}
    name = {bytes: "bytes", bytearray: "bytearray", memoryview: "memoryview"}.get(holder, "array.array")  # type: ignore[call-overload]
    with pytest.raises(
        PromptTypeError, match=rf"must be a list of int, got raw bytes \({re.escape(name)}\)"
    ) as caught:
        TokensPrompt(**kwargs)
    assert caught.value.path == f"$.{field}"


def test_prompt_embeds_are_the_shape_vllm_reads() -> None:
    # (seq_len, hidden_size), or a batch of one that vLLM's renderer squeezes.
    import torch

    for shape in ((), (4,), (2, 2, 3), (1, 1, 2, 3)):
        with pytest.raises(
            InvalidPromptError, match=rf"^\$\.prompt_embeds: must be of shape .*got {re.escape(str(shape))}$"
        ):
            EmbedsPrompt(prompt_embeds=torch.zeros(shape))
    for shape in ((2, 3), (1, 2, 3)):
        assert tuple(EmbedsPrompt(prompt_embeds=torch.zeros(shape)).prompt_embeds.shape) == shape


def test_unknown_field_is_refused() -> None:
    with pytest.raises(TypeError, match="colour"):
        TextPrompt(prompt="x", colour="red")  # type: ignore[call-arg]


def test_ints_beyond_64_bits_in_media_are_refused() -> None:
    with pytest.raises(InvalidPromptError) as caught:
        TextPrompt(prompt="x", multi_modal_data={"video": (np.zeros((1, 2, 2, 3), np.uint8), {"n": 1 << 64})})
    assert caught.value.path == "$.multi_modal_data.video[0][1].n"
    TextPrompt(
        prompt="x", multi_modal_data={"video": (np.zeros((1, 2, 2, 3), np.uint8), {"n": (1 << 64) - 1})}
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda torch: torch.quantize_per_tensor(torch.rand(1, 2, 2, 3), 0.1, 0, torch.quint8),
        lambda torch: torch.eye(3).to_sparse(),
        lambda torch: torch.eye(3).to_sparse_csr(),
        lambda torch: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
    ],
    ids=["quantized", "sparse COO", "sparse CSR", "nested"],
)
def test_tensors_vllm_cannot_read_are_refused_not_kept(make: Any) -> None:
    # docs/design.md "What is not sealed": these are refused, never kept as given.
    tensor = make(pytest.importorskip("torch"))
    with pytest.raises(PromptTypeError, match="vLLM's hasher cannot read this tensor") as caught:
        TextPrompt(prompt="x", multi_modal_data={"video": [tensor]})
    assert caught.value.path == "$.multi_modal_data.video[0]"


class _ShapeLie(np.ndarray):  # type: ignore[type-arg]
    shape = property(lambda self: (1,))  # type: ignore[assignment]


def test_values_that_escaped_as_other_libraries_errors_are_refused_by_field_or_kept() -> None:
    # Each escaped as torch's, the dataclass's or numpy's own error, naming no field
    # (found by an adversarial review).
    torch = pytest.importorskip("torch")
    nested = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(4)])  # torch refuses its len()
    for modality in ("audio", "image"):
        with pytest.raises(PromptTypeError, match="nested tensor") as caught:
            TextPrompt(prompt="x", multi_modal_data={modality: nested})
        assert caught.value.path == f"$.multi_modal_data.{modality}"
    with pytest.raises(PromptTypeError, match="nested tensor"):
        from_vllm({"prompt": "x", "multi_modal_data": {"image": nested}})

    @dataclasses.dataclass(slots=True)
    class MediaWithBytes:  # vLLM's name and fields, but slotted: not vLLM's dataclass
        media: object
        original_bytes: bytes

    with pytest.raises(PromptTypeError, match="unsupported media value") as caught:
        TextPrompt(prompt="x", multi_modal_data={"image": MediaWithBytes(Image.new("RGB", (2, 2)), b"x")})
    assert caught.value.path == "$.multi_modal_data.image[0]"
    # A subclass's shape is not taken on its word: the record keeps the plain array it carries.
    pixels = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    own = TextPrompt(prompt="x", multi_modal_data={"image": pixels.view(_ShapeLie)}).multi_modal_data[
        "image"
    ][0]
    assert type(own) is np.ndarray and own.shape == (4, 4, 3) and np.array_equal(own, pixels)


def test_a_tensor_no_engine_can_key_is_refused_with_our_error() -> None:
    # vLLM's hasher fails (a torch RuntimeError) on a one-element bfloat16 tensor with a
    # stride other than 1; the record refuses it up front, naming where it was.
    torch = pytest.importorskip("torch")
    strided = torch.zeros((2, 3), dtype=torch.bfloat16)[::2, ::3]
    with pytest.raises(PromptTypeError, match=r"stride \(6, 3\).*contiguous_format") as caught:
        TextPrompt(
            prompt="x", multi_modal_data={"audio": [(np.zeros(4, np.float32), 16000), (strided, 16000)]}
        )
    assert caught.value.path == "$.multi_modal_data.audio[1][0]"
    fixed = strided.clone(memory_format=torch.contiguous_format)  # what the message advises
    for fine in (fixed, torch.zeros(4, dtype=torch.bfloat16)[::2], torch.zeros(2)[::2]):
        TextPrompt(prompt="x", multi_modal_data={"audio": [(fine, 16000)]})


_FRAME = np.zeros((4, 4, 3), np.uint8)
_VIDEO = np.zeros((2, 4, 4, 3), np.uint8)
_WAVE = np.zeros(16, np.float32)


@pytest.mark.parametrize(
    ("data", "path", "match"),
    [
        ({"image": b"\x89PNG\r\n"}, "$.multi_modal_data.image", r"raw bytes \(bytes\) are not image data"),
        ({"audio": [bytearray(b"RIFF")]}, "$.multi_modal_data.audio[0]", r"\(bytearray\) are not audio data"),
        (
            {"video": memoryview(np.zeros((2, 4, 4, 3), np.uint8))},
            "$.multi_modal_data.video",
            r"\(memoryview\)",
        ),
        ({"video": (_FRAME, _FRAME, _FRAME)}, "$.multi_modal_data.video", "frames of one video"),
        ({"video": (_FRAME,)}, "$.multi_modal_data.video", "frames of one video"),
        ({"video": [(_VIDEO,)]}, "$.multi_modal_data.video[0]", "a tuple of 1 is not a video item"),
        ({"video": [_VIDEO, (_VIDEO, {}, 3)]}, "$.multi_modal_data.video[1]", "a tuple of 3"),
        ({"audio": (_WAVE, 16000, 1)}, "$.multi_modal_data.audio[0]", "a tuple of 3 is not an audio item"),
        ({"audio": [_WAVE, (_WAVE,)]}, "$.multi_modal_data.audio[1]", "a tuple of 1 is not an audio item"),
        ({"audio": ("speech.wav", 16000)}, "$.multi_modal_data.audio[0]", "a str is not a waveform"),
        ({"audio": [(b"RIFF", 16000)]}, "$.multi_modal_data.audio[0]", "a bytes is not a waveform"),
    ],
    ids=[
        "bytes-image",
        "bytearray-audio",
        "memoryview-video",
        "tuple-of-frames",
        "one-frame-tuple",
        "1-tuple-item",
        "3-tuple-item",
        "audio-3-tuple",
        "audio-1-tuple-item",
        "audio-str-waveform",
        "audio-bytes-waveform",
    ],
)
def test_media_vllm_cannot_read_as_the_record_would_send_it_is_refused(
    data: dict[str, Any], path: str, match: str
) -> None:
    # A file's bytes are read as numbers by vLLM's parser; a tuple of 3-D frames (vLLM:
    # videos, each a 3-D array) would be sent in the record's list (vLLM: the frames of
    # one video); a video item that is a tuple other than a pair fails vLLM's unpacking.
    with pytest.raises(PromptTypeError, match=match) as caught:
        TextPrompt(prompt="x", multi_modal_data=data)
    assert caught.value.path == path
    assert TextPrompt(prompt="x", multi_modal_data={"thumb": b"kept"}).multi_modal_data["thumb"][0] == b"kept"


class _RaisingFloat32(np.float32):
    def __float__(self) -> float:
        raise ValueError("no float")


class _LyingRate(float):
    def __gt__(self, other: object) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return True


@pytest.mark.parametrize(
    ("rate", "error"),
    [
        (0, InvalidPromptError),
        (0.0, InvalidPromptError),
        (0.5, InvalidPromptError),  # vLLM's resamplers read int(round(rate)): 0
        (5e-324, InvalidPromptError),
        (np.timedelta64(5, "s"), PromptTypeError),  # numpy counts it an integer
        (_RaisingFloat32(16000), PromptTypeError),
        (-0.0, InvalidPromptError),
        (-16000, InvalidPromptError),
        (np.int64(-1), InvalidPromptError),
        (float("nan"), InvalidPromptError),
        (np.float32("nan"), InvalidPromptError),
        (float("inf"), InvalidPromptError),
        (-float("inf"), InvalidPromptError),
        (_LyingRate(-1.0), InvalidPromptError),
        ("16000", PromptTypeError),
        (True, PromptTypeError),
        (np.bool_(True), PromptTypeError),
        (np.array(16000.0), PromptTypeError),
        ([16000], PromptTypeError),
        (1 + 2j, PromptTypeError),
    ],
    ids=repr,
)
def test_an_audio_sample_rate_vllm_cannot_resample_from_is_refused_by_name(rate: object, error: type) -> None:
    # vLLM resamples (waveform, rate) to the model's rate: 0, a negative rate, NaN or an
    # infinite one fail there with an error naming no field; a str or a bool it reads
    # as float(rate), by accident.
    wave = np.zeros(16, np.float32)
    item = (wave, rate)
    with pytest.raises(error, match="a sample rate must be") as caught:
        TextPrompt(prompt="<audio>", multi_modal_data={"audio": [wave, item]})
    assert caught.value.path == "$.multi_modal_data.audio[1][1]"
    assert item == (wave, rate) and item[0] is wave  # the caller's item, as given


@pytest.mark.parametrize("rate", [16000, 44100.0, np.float32(8000), np.int16(22050), 0.6, None])
def test_a_positive_finite_sample_rate_or_none_is_taken_as_given(rate: object) -> None:
    record = TextPrompt(prompt="<audio>", multi_modal_data={"audio": (_WAVE, rate)})
    (item,) = record.multi_modal_data["audio"]
    assert item[1] == rate and type(item[1]) is type(rate)


def _tensor_without_pixels() -> Any:
    torch = pytest.importorskip("torch")
    return torch.zeros(3, 0, 4)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: [[0, 0, 0]] * 4, PromptTypeError, "a list of no image is not an image"),
        (lambda: (1, 2, 3), PromptTypeError, "a tuple of no image is not an image"),
        (lambda: [], PromptTypeError, "a list of no image is not an image"),
        (lambda: {"pixels": np.zeros((2, 2, 3), np.uint8)}, PromptTypeError, "a dict is not an image"),
        (lambda: Image.new("RGB", (0, 4)), InvalidPromptError, r"shape \(4, 0\) has no pixels"),
        (lambda: Image.new("L", (0, 0)), InvalidPromptError, r"shape \(0, 0\) has no pixels"),
        (lambda: np.zeros((0, 4, 3), np.uint8), InvalidPromptError, r"shape \(0, 4, 3\) has no pixels"),
        (lambda: np.zeros((4, 4, 0), np.uint8), InvalidPromptError, "has no pixels"),
        (_tensor_without_pixels, InvalidPromptError, r"shape \(3, 0, 4\) has no pixels"),
        (
            lambda: [Image.new("RGB", (2, 2)), Image.new("RGB", (0, 28))],
            InvalidPromptError,
            "a list holding an image without pixels",
        ),
    ],
    ids=[
        "nested-list",
        "tuple",
        "empty-list",
        "dict",
        "pil-0-wide",
        "pil-0x0",
        "array-0-high",
        "array-0-channels",
        "tensor",
        "list-holding-one",
    ],
)
def test_an_image_item_the_models_processor_fails_on_is_refused_by_name(
    make: Callable[[], object], error: type, match: str
) -> None:
    # vLLM's parser passes such an item on, and the model's processor fails on it after
    # routing, with an error that names no field (tests/vllm/test_validation_parity.py).
    item = make()
    with pytest.raises(error, match=match) as caught:
        TextPrompt(prompt="<image><image>", multi_modal_data={"image": [np.zeros((2, 2, 3), np.uint8), item]})
    assert caught.value.path == "$.multi_modal_data.image[1]"
    # Under a modality of its own a record takes it as it is; a one-pixel image is an
    # image, and a list of images is the model's to read (Qwen2-VL's processor takes it).
    assert (
        TextPrompt(prompt="x", multi_modal_data={"layout": [item]}).multi_modal_data["layout"][0] is not None
    )
    TextPrompt(prompt="<image>", multi_modal_data={"image": [[np.zeros((2, 2, 3), np.uint8)]]})
    TextPrompt(prompt="<image>", multi_modal_data={"image": [Image.new("RGB", (1, 1))]})


@pytest.mark.parametrize(
    ("modality", "item", "path", "match"),
    [
        ("video", np.zeros((0, 4, 4, 3), np.uint8), "[1]", r"a video of shape \(0, 4, 4, 3\) has no pixels"),
        ("video", np.zeros((2, 4, 0, 3), np.uint8), "[1]", "has no pixels"),
        ("video", [], "[1]", "a video of no frames"),
        ("video", ([], {"fps": 2.0}), "[1][0]", "a video of no frames"),
        ("video", [Image.new("RGB", (0, 0))], "[1][0]", r"a frame of shape \(0, 0\) has no pixels"),
        ("audio", np.zeros(0, np.float32), "[1]", r"a waveform of shape \(0,\) has no samples"),
        ("audio", (np.zeros(0, np.float32), 16000), "[1][0]", "has no samples"),
        ("audio", [], "[1]", "an empty list of samples"),
    ],
    ids=[
        "video-0-frames",
        "video-0-wide",
        "no-frames",
        "no-frames-with-metadata",
        "0x0-frame",
        "audio",
        "audio-tuple",
        "audio-list",
    ],
)
def test_a_video_or_audio_without_pixels_or_samples_is_refused_by_name(
    modality: str, item: object, path: str, match: str
) -> None:
    # vLLM's processor fails on it after routing (tests/vllm/test_validation_parity.py).
    valid = {"video": np.zeros((2, 4, 4, 3), np.uint8), "audio": np.zeros(8, np.float32)}[modality]
    with pytest.raises(InvalidPromptError, match=match) as caught:
        TextPrompt(prompt="x", multi_modal_data={modality: [valid, item]})
    assert caught.value.path == f"$.multi_modal_data.{modality}{path}"


class _SizeRaises(Image.Image):
    @property
    def height(self) -> int:  # type: ignore[override]
        raise ValueError("height")


def test_an_image_whose_sizes_cannot_be_read_raises_no_foreign_error() -> None:
    # The pixel check reads sizes a subclass may break; what it cannot read is left to
    # the freezing, which reads the image's own data: no ValueError escapes.
    image = _SizeRaises()
    image.im = Image.new("RGB", (2, 2)).im
    image._mode, image._size = "RGB", (2, 2)
    with contextlib.suppress(OmniRequestsError):
        TextPrompt(prompt="<image>", multi_modal_data={"image": [image]})


def test_an_image_file_that_cannot_be_decoded_is_refused_by_name() -> None:
    # Pillow decodes a file image on first use: the record decodes it when built, so a
    # truncated file fails there, with our error, not Pillow's OSError at the first key.
    data = io.BytesIO()
    Image.new("RGB", (64, 64), (9, 8, 7)).save(data, "PNG")
    for build in (
        lambda image: TextPrompt(prompt="<image>", multi_modal_data={"image": image}),
        lambda image: from_vllm({"prompt": "<image>", "multi_modal_data": {"image": [image]}}),
    ):
        truncated = Image.open(io.BytesIO(data.getvalue()[:60]))
        with pytest.raises(InvalidPromptError, match=r"cannot be read \(OSError") as caught:
            build(truncated)
        assert caught.value.path == "$.multi_modal_data.image[0]"


def test_a_tiff_whose_orientation_was_deleted_before_loading_is_refused_by_name() -> None:
    # Pillow's TIFF reader turns the pixels by the orientation it read, so the loaded
    # image says 6x5 but holds 5x6 pixels: keys and seals failed deep in Pillow
    # (SystemError: tile cannot extend outside image; ValueError: images do not match).
    exif = Image.Exif()
    exif[0x0112] = 6
    data = io.BytesIO()
    Image.fromarray(np.arange(90, dtype=np.uint8).reshape(6, 5, 3)).save(data, "TIFF", exif=exif.tobytes())

    def edited() -> Image.Image:
        image = Image.open(io.BytesIO(data.getvalue()))
        del image.getexif()[0x0112]
        return image

    with pytest.raises(InvalidPromptError, match="holds its pixels at 5x6 but the image says 6x5") as caught:
        TextPrompt(prompt="<image>", multi_modal_data={"image": edited()})
    assert caught.value.path == "$.multi_modal_data.image[0]"
    hasher = MediaHasher("m")
    for key_of in (hasher.key, hasher.content_key, hasher.fingerprint):
        with pytest.raises(ValueError, match="holds its pixels at 5x6"):
            key_of("image", edited())
    image = edited()
    image.load()
    assert image.copy().size == (5, 6)  # the hint's way out reads the pixels as held
    assert TextPrompt(prompt="<image>", multi_modal_data={"image": image.copy()}).multi_modal_data


@pytest.mark.parametrize("mode", ["L", "P"])
def test_an_image_pillow_cannot_convert_is_refused_by_name_when_built(mode: str) -> None:
    # vLLM's parser applies info["transparency"] through Pillow's convert, which raises
    # on a float (TypeError for L, ValueError for P); even with a user UUID (no key to
    # derive) the engine would fail. The record refuses the image and says where.
    image = Image.new(mode, (8, 8), 5)
    image.info["transparency"] = 5.0
    with pytest.raises(
        InvalidPromptError, match=r"cannot turn this (L|P) image into RGB \((Type|Value)Error"
    ) as caught:
        TextPrompt(
            prompt="<image>",
            multi_modal_data={"image": [np.zeros((2, 2, 3), np.uint8), image]},
            multi_modal_uuids={"image": ["a", "b"]},
        )
    assert caught.value.path == "$.multi_modal_data.image[1]"
    assert "info['transparency']" in caught.value.message
    assert image.info["transparency"] == 5.0 and image.mode == mode  # the caller's image untouched
    # Under another modality it is no image vLLM parses: taken, and keyed by its pixels.
    record = TextPrompt(prompt="x", multi_modal_data={"sketch": image})
    assert to_vllm(scope_to_replica(record, 0, hasher=MediaHasher("m")))["multi_modal_uuids"]["sketch"][0]
    if mode == "L":
        with pytest.raises(TypeError):  # the content key itself raises, as vLLM's parser does
            MediaHasher("m").content_key("image", image)


def test_a_video_frames_hand_out_vllm_cannot_parse_as_an_image_is_refused_under_image() -> None:
    # Video frames are no image vLLM's parser turns into RGB, so a record takes them;
    # one's hand-out given back under "image" must still be refused.
    bad = Image.new("L", (8, 8), 7)
    bad.info["transparency"] = 5.0
    video = TextPrompt(prompt="<video>", multi_modal_data={"video": [[bad, bad.copy()]]})
    frame = to_vllm(video)["multi_modal_data"]["video"][0][0]
    for build in (
        lambda: TextPrompt(prompt="<image>", multi_modal_data={"image": frame}),
        lambda: from_vllm({"prompt": "<image>", "multi_modal_data": {"image": [frame]}}),
    ):
        with pytest.raises(InvalidPromptError, match="cannot turn this L image into RGB"):
            build()


# -- EmbeddingFields: one item of vLLM's dict form of a model's embedding fields --


@pytest.fixture
def torch_module() -> Any:
    return pytest.importorskip("torch")


_LAYOUT = {"image_embeds": "flat", "image_grid_thw": "batched"}


def _fields(torch: Any, rows: int, grid: list[int], fill: float = 0.0) -> EmbeddingFields:
    return EmbeddingFields(
        {"image_embeds": torch.full((rows, 8), fill), "image_grid_thw": torch.tensor(grid)}, _LAYOUT
    )


@pytest.mark.parametrize(
    ("fields", "layout", "path", "error"),
    [
        ({"image_embeds": "x"}, {"image_embeds": "flat"}, "$.fields.image_embeds", PromptTypeError),
        (
            {"image_embeds": np.zeros((2, 2))},
            {"image_embeds": "flat"},
            "$.fields.image_embeds",
            PromptTypeError,
        ),
        ({"image_embeds": None}, {"image_embeds": "flat"}, "$.fields.image_embeds", PromptTypeError),
        ({"a": "t"}, {"a": "stacked"}, "$.layout.a", InvalidPromptError),
        ({"a": "t"}, {"b": "batched"}, "$.layout.b", InvalidPromptError),
        ({"a": "t"}, {}, "$.layout.a", InvalidPromptError),
        ({"a": "t"}, {"a": "flat:2"}, "$.fields.a", InvalidPromptError),
        ({}, {}, "$.fields", InvalidPromptError),
    ],
)
def test_embedding_fields_refuse_bad_fields_naming_them(
    torch_module: Any, fields: dict[str, Any], layout: dict[str, str], path: str, error: type[Exception]
) -> None:
    fields = {
        k: torch_module.zeros(2, 4) if isinstance(v, str) and v == "t" else v for k, v in fields.items()
    }
    with pytest.raises(error) as caught:
        EmbeddingFields(fields, layout)
    assert caught.value.path == path  # type: ignore[attr-defined]


def test_embedding_fields_compare_by_fields_in_order_and_layout(torch_module: Any) -> None:
    torch = torch_module
    a = _fields(torch, 4, [1, 4, 4])
    assert a == _fields(torch, 4, [1, 4, 4]) and hash(a) == hash(_fields(torch, 4, [1, 4, 4]))
    assert a != _fields(torch, 4, [1, 4, 4], fill=-0.0)  # by bytes, as the hasher sees them
    assert a != EmbeddingFields(dict(a), {"image_embeds": "flat", "image_grid_thw": "shared"})
    reordered = EmbeddingFields(
        {"image_grid_thw": a["image_grid_thw"], "image_embeds": a["image_embeds"]}, _LAYOUT
    )
    assert a != reordered  # vLLM hashes the dict in order: another key
    assert a != dict(a)
    assert a.layout == {"image_embeds": "flat:0", "image_grid_thw": "batched"}
    with pytest.raises(AttributeError):
        a._fields = {}  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(a)) == a


def test_records_hold_embedding_fields_items_and_key_them_as_their_dicts(torch_module: Any) -> None:
    torch = torch_module
    a, b = _fields(torch, 1, [1, 2, 2], 1.0), _fields(torch, 4, [1, 4, 4], 4.0)
    record = TextPrompt(
        prompt="x", multi_modal_data={"image": [a, b]}, multi_modal_uuids={"image": [None, "u"]}
    )
    single = TextPrompt(prompt="x", multi_modal_data={"image": a})
    assert list(single.multi_modal_data["image"]) == [a]
    hasher = MediaHasher("m")
    # The item's key is vLLM's key of its dict (what DictEmbeddingItems.get(i) returns).
    assert hasher.key("image", a) == hasher.key(
        "image", {"image_embeds": a["image_embeds"], "image_grid_thw": a["image_grid_thw"]}
    )
    assert pickle.loads(pickle.dumps(record)) == record
    assert record != TextPrompt(
        prompt="x", multi_modal_data={"image": [a, a]}, multi_modal_uuids={"image": [None, "u"]}
    )
    assert "EmbeddingFields" in repr(record)
    replaced = record.replace_media({"image": [b]})
    assert list(replaced.multi_modal_data["image"]) == [b] and "image" not in replaced.multi_modal_uuids
    with pytest.raises(InvalidPromptError):  # evolve keeps "u" for an item it was not given with
        attrs.evolve(record, multi_modal_data={"image": [a, a]})


def test_a_modality_of_embedding_fields_is_checked_as_one_mergeable_dict(torch_module: Any) -> None:
    torch = torch_module
    a = _fields(torch, 1, [1, 2, 2])
    cases: list[tuple[Any, str, type[Exception]]] = [
        ([a, None], "$.multi_modal_data.image[1]", PromptTypeError),
        ([a, torch.zeros(1, 8)], "$.multi_modal_data.image[1]", PromptTypeError),
        (
            [a, EmbeddingFields(dict(a), {"image_embeds": "flat", "image_grid_thw": "shared"})],
            "$.multi_modal_data.image[1]",
            InvalidPromptError,
        ),
        ([a, _fields(torch, 1, [1, 2])], "$.multi_modal_data.image[1].image_grid_thw", InvalidPromptError),
        (
            [
                a,
                EmbeddingFields(
                    {"image_embeds": torch.zeros(1, 9), "image_grid_thw": torch.tensor([1, 2, 2])}, _LAYOUT
                ),
            ],
            "$.multi_modal_data.image[1].image_embeds",
            InvalidPromptError,
        ),
        (
            [
                a,
                EmbeddingFields(
                    {
                        "image_embeds": torch.zeros(1, 8, dtype=torch.float16),
                        "image_grid_thw": torch.tensor([1, 2, 2]),
                    },
                    _LAYOUT,
                ),
            ],
            "$.multi_modal_data.image[1].image_embeds",
            InvalidPromptError,
        ),
        ([(a, 1)], "$.multi_modal_data.image[0][0]", PromptTypeError),
    ]
    for items, path, error in cases:
        with pytest.raises(error) as caught:
            TextPrompt(
                prompt="x", multi_modal_data={"image": items}, multi_modal_uuids={"image": ["u"] * len(items)}
            )
        assert caught.value.path == path, items  # type: ignore[attr-defined]
    with pytest.raises(PromptTypeError, match="only for image, video and audio") as caught:
        TextPrompt(prompt="x", multi_modal_data={"motion": [a]})
    shared = {"s": torch.ones(2)}
    rules = {"video_embeds": "flat", "s": "shared"}
    one = EmbeddingFields({"video_embeds": torch.zeros(1, 8), **shared}, rules)
    other = EmbeddingFields({"video_embeds": torch.zeros(1, 8), "s": torch.zeros(2)}, rules)
    with pytest.raises(InvalidPromptError, match="shared field") as caught:
        TextPrompt(prompt="x", multi_modal_data={"video": [one, other]})
    assert caught.value.path == "$.multi_modal_data.video[1].s"
    with pytest.raises(InvalidPromptError, match="not audio_embeds") as caught:
        TextPrompt(prompt="x", multi_modal_data={"audio": [one]})  # made for another modality
    assert caught.value.path == "$.multi_modal_data.audio[0]"


def test_embedding_fields_render_as_the_one_merged_dict_vllm_takes(torch_module: Any) -> None:
    torch = torch_module
    to_vllm = pytest.importorskip("omni_requests_vllm").to_vllm
    a, b = _fields(torch, 1, [1, 2, 2], 1.0), _fields(torch, 4, [1, 4, 4], 4.0)
    shared = torch.ones(3)
    rules = {"video_embeds": "flat:1", "s": "shared"}
    c = EmbeddingFields({"video_embeds": torch.zeros(2, 3, 8), "s": shared}, rules)
    d = EmbeddingFields({"video_embeds": torch.ones(2, 1, 8), "s": shared}, rules)
    record = TextPrompt(prompt="x", multi_modal_data={"image": [a, b], "video": [c, d]})
    sent = to_vllm(record)["multi_modal_data"]
    assert list(sent["image"]) == ["image_embeds", "image_grid_thw"]
    assert sent["image"]["image_embeds"][:, 0].tolist() == [1.0, 4.0, 4.0, 4.0, 4.0]
    assert sent["image"]["image_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 4]]
    assert tuple(sent["video"]["video_embeds"].shape) == (2, 4, 8)
    assert sent["video"]["s"].tolist() == shared.tolist() and sent["video"]["s"] is not shared  # copies
    assert to_vllm(record)["multi_modal_data"]["image"] is not sent["image"]  # a new dict each call


def test_the_wire_format_refuses_embedding_fields_naming_the_item(torch_module: Any) -> None:
    from omni_requests import wire

    record = TextPrompt(prompt="x", multi_modal_data={"image": _fields(torch_module, 1, [1, 2, 2])})
    with pytest.raises(PromptTypeError, match="EmbeddingFields has no wire form") as caught:
        wire.encode(record)
    assert caught.value.path == "$.multi_modal_data.image[0]"
