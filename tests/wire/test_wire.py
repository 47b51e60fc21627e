"""The wire format, case by case: media forms, what a key reads, versions, limits, errors."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import uuid
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image
from PIL.TiffImagePlugin import IFDRational

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    OmniRequestsError,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
    media_keys,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests.wire import WIRE_VERSION, WireError, WireVersionError, decode, encode

from ._plain import picture, plain

HASHER = MediaHasher("/models/wire")


def _tag(code: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, b"")


def _round_trip(record: Any) -> Any:
    back = decode(encode(record))
    assert back == record
    assert picture(back) == picture(record)
    return back


def _backed_by_bytes(array: np.ndarray[Any, Any]) -> bool:
    while isinstance(array.base, np.ndarray):
        assert not array.flags.writeable
        array = array.base
    return not array.flags.writeable and isinstance(array.base, bytes)


def test_arrays_of_any_layout_and_byte_order_decode_read_only_and_backed_by_bytes() -> None:
    big_endian = np.arange(24, dtype=">i4").reshape(2, 3, 4)
    strided = np.arange(60, dtype=np.float64).reshape(3, 4, 5)[:, ::2, ::-1]
    fortran = np.asfortranarray(np.arange(24, dtype=np.uint16).reshape(2, 3, 4))
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": [big_endian, strided, fortran]})
    back = _round_trip(record)
    for sent, got in zip(record.multi_modal_data["image"], back.multi_modal_data["image"], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and got.tobytes() == sent.tobytes()
        assert _backed_by_bytes(got)
    assert back.multi_modal_data["image"][0].dtype.str == ">i4"


def test_videos_audio_and_frame_lists_keep_their_shapes() -> None:
    frames = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    metadata = {"total_num_frames": 2, "fps": 2.0, "duration": 1.0, "frames_indices": [0, 1]}
    record = TokensPrompt(
        prompt_token_ids=[1, 2],
        multi_modal_data={
            "video": [(frames, metadata), [frames[0], frames[1]], frames],
            "audio": [(np.zeros(5, np.float32), 16000), [0.5, -0.25]],
        },
    )
    back = _round_trip(record)
    assert type(back.multi_modal_data["video"][0]) is tuple
    assert list(back.multi_modal_data["video"][0][1]) == list(metadata)  # metadata order is in the key


def test_modality_order_and_user_uuids_survive() -> None:
    pixels = np.zeros((2, 2, 3), np.uint8)
    record = TextPrompt(
        prompt="x",
        multi_modal_data={"video": [pixels[None]], "image": [pixels, None], "audio": [np.ones(3)]},
        multi_modal_uuids={"image": ["cat", "cached"], "clip": ["only-uuid"]},
    )
    back = _round_trip(record)
    assert picture(back)["order"] == ["video", "image", "audio"]
    assert picture(back)["uuid_order"] == ["image", "clip"]


@pytest.mark.parametrize(
    "policy",
    [None, KeyPolicy(namespaces=True, tenant="acme", tenant_content=True), KeyPolicy(bind_content=True)],
)
def test_scope_hasher_and_policy_survive(policy: KeyPolicy | None) -> None:
    record = TextPrompt(
        prompt="<image>",
        multi_modal_data={"image": [np.ones((2, 2, 3), np.uint8), np.zeros((2, 2, 3), np.uint8)]},
        multi_modal_uuids={"image": ["u", None]},
    )
    scoped = scope_to_replica(record, 3, hasher=MediaHasher("org/m", "sha512"), stage_id=2, policy=policy)
    back = _round_trip(scoped)
    assert back.scope == scoped.scope
    assert rendered_uuids(back) == rendered_uuids(scoped)


def _exif_image(orientation: object, image_id: object, transparency: object = None) -> Any:
    image = Image.fromarray(np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3) * 3)
    if transparency is not None:
        image.info["transparency"] = transparency
    exif = image.getexif()
    if orientation is not None:
        exif[0x0112] = orientation
    if image_id is not None:
        exif[0x800D] = image_id
    return image


@pytest.mark.parametrize(
    "image",
    [
        _exif_image(6, None),
        _exif_image(None, uuid.UUID(int=7)),
        _exif_image(3, str(uuid.UUID(int=8))),
        _exif_image(None, None, transparency=(3, 6, 9)),
        Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4)).convert("P"),
        Image.new("RGBA", (3, 2), (1, 2, 3, 4)).convert("PA"),
        Image.new("1", (9, 3), 1),
        Image.new("I;16B", (3, 3), 500),
    ],
    ids=[
        "orientation",
        "image-id",
        "image-id-str",
        "transparency",
        "P",
        "PA",
        "1",
        "I;16B",
    ],
)
def test_images_keep_what_their_key_reads(image: Any) -> None:
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    back = _round_trip(record)
    got = back.multi_modal_data["image"][0]
    assert HASHER.content_key("image", got) == HASHER.content_key("image", image)
    assert HASHER.key("image", got) == HASHER.key("image", image)
    assert HASHER.fingerprint("image", got) == HASHER.fingerprint("image", image)


@pytest.mark.parametrize(
    "orientation", [np.int64(8), 3.0, IFDRational(6, 1)], ids=["numpy-int", "float", "rational"]
)
def test_an_orientation_that_equals_a_whole_number_arrives_as_that_int(orientation: object) -> None:
    # vLLM's parser looks the orientation up in a dict, where 3.0 and np.int64(8) find
    # 3 and 8 and turn the image: the receiver must turn it too (it used to get none).
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _exif_image(orientation, None)})
    back = decode(encode(record)).multi_modal_data["image"][0]
    assert back.getexif()[0x0112] == orientation and type(back.getexif()[0x0112]) is int
    assert HASHER.content_key("image", back) == HASHER.content_key(
        "image", record.multi_modal_data["image"][0]
    )


@pytest.mark.parametrize(
    "orientation", [1, 9, "6", 2**64 + 6, [6]], ids=["1", "9", "str", "beyond-64-bits", "unhashable"]
)
def test_an_orientation_that_turns_nothing_does_not_travel(orientation: object) -> None:
    # vLLM's parser finds no turn for these; an int beyond 64 bits used to fail encode.
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _exif_image(orientation, None)})
    back = decode(encode(record))
    assert 0x0112 not in back.multi_modal_data["image"][0].getexif()
    assert back == record
    assert HASHER.content_key("image", back.multi_modal_data["image"][0]) == HASHER.content_key(
        "image", record.multi_modal_data["image"][0]
    )


def test_an_orientation_whose_turn_fails_in_vllms_parser_does_not_travel() -> None:
    # vLLM's parser keeps this image unturned (an XMP entry that is no text fails
    # Pillow's transpose); XMP does not travel, so the receiver must get no turn either.
    image = Image.fromarray(np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3))  # EXIF not read yet
    exif = Image.Exif()
    exif[0x0112] = 6
    image.info["exif"], image.info["xmp"] = exif.tobytes(), 123
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    back = decode(encode(record))
    assert back == record
    assert HASHER.content_key("image", back.multi_modal_data["image"][0]) == HASHER.content_key(
        "image", record.multi_modal_data["image"][0]
    )


def test_a_palette_image_keys_the_same_before_its_palette_is_realized() -> None:
    # putpalette leaves the palette pending until Pillow first reads the pixels; the
    # content key converts to RGB through the palette, so a receiver must get it in the core.
    image = Image.new("P", (4, 4))
    image.putpalette(bytes(range(48)), "RGB")
    key = MediaHasher("m").content_key("image", image.copy())
    back = decode(encode(TextPrompt(prompt="", multi_modal_data={"image": image})))
    assert MediaHasher("m").content_key("image", back.multi_modal_data["image"][0]) == key


def test_tensors_bfloat16_and_strided_survive() -> None:
    torch = pytest.importorskip("torch")
    from omni_requests import EmbedsPrompt

    embeds = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16).t()
    record = EmbedsPrompt(
        prompt_embeds=embeds,
        negative_prompt_embeds=[torch.ones(2, 2, dtype=torch.float16)],
        multi_modal_data={"image": [torch.arange(6.0).reshape(2, 3)[:, ::2]]},
    )
    back = _round_trip(record)
    assert back.prompt_embeds.dtype == torch.bfloat16 and back.prompt_embeds.shape == (4, 3)
    assert media_keys(back, HASHER)["image"][0] == media_keys(record, HASHER)["image"][0]


def test_tensors_decode_on_the_cpu_whatever_the_default_device() -> None:
    # A server that sets torch's default device (for its model) decodes messages too:
    # found by a review (helper-88), every tensor was refused as "malformed" under one.
    torch = pytest.importorskip("torch")
    video = torch.arange(4 * 8 * 8 * 3, dtype=torch.float32).reshape(4, 8, 8, 3)
    message = encode(TextPrompt(prompt="<video>", multi_modal_data={"video": video}))
    torch.set_default_device("meta")  # "cuda" on a GPU server takes the same road
    try:
        back = decode(message)
    finally:
        torch.set_default_device(None)
    sent = back.multi_modal_data["video"][0]
    assert sent.device.type == "cpu" and torch.equal(sent, video)


def test_options_keep_types_order_and_big_ints() -> None:
    options = {
        "b": (1, 2),
        "a": [1.5, None, float("nan")],
        "big": 2**80,
        "n": np.float32(0.5),
        "raw": b"\x00",
    }
    record = TextPrompt(
        prompt="x", mm_processor_kwargs=options, additional_information={"k": {"z": 1, "y": 2}}
    )
    back = _round_trip(record)
    assert list(back.mm_processor_kwargs) == ["b", "a", "big", "n", "raw"]
    assert type(back.mm_processor_kwargs["n"]) is np.float32
    assert plain(dict(back.mm_processor_kwargs)) != plain({})


def test_encoder_decoder_errors_name_the_nested_field() -> None:
    good = EncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="e"), decoder_prompt=TextPrompt(prompt="d"))
    tree = msgspec.msgpack.decode(encode(good))
    tree[2][2]["decoder_prompt"][2]["prompt"] = 5
    with pytest.raises(PromptTypeError) as caught:
        decode(msgspec.msgpack.encode(tree))
    assert caught.value.path == "$.decoder_prompt.prompt"


def test_decoding_runs_the_records_checks() -> None:
    tree = msgspec.msgpack.decode(
        encode(TextPrompt(prompt="", multi_modal_data={"image": np.zeros((1, 1, 3), np.uint8)}))
    )
    tree[2][2]["multi_modal_uuids"] = [["image", ["stage0:rep1:abc"]]]
    with pytest.raises(InvalidPromptError) as caught:
        decode(msgspec.msgpack.encode(tree))
    assert caught.value.path == "$.multi_modal_uuids.image[0]"
    assert "already scoped" in caught.value.message


def test_a_decoded_prompt_cannot_give_one_uuid_to_two_items() -> None:
    two = [np.zeros((1, 1, 3), np.uint8), np.ones((1, 1, 3), np.uint8)]
    record = TextPrompt(prompt="", multi_modal_data={"image": two}, multi_modal_uuids={"image": ["a", "b"]})
    tree = msgspec.msgpack.decode(encode(record))
    tree[2][2]["multi_modal_uuids"] = [["image", ["a", "a"]]]
    with pytest.raises(InvalidPromptError, match="'a' also names") as caught:
        decode(msgspec.msgpack.encode(tree))
    assert caught.value.path == "$.multi_modal_uuids.image[1]"


def test_another_version_is_refused_by_name() -> None:
    tree = msgspec.msgpack.decode(encode(TextPrompt(prompt="x")))
    tree[1] = WIRE_VERSION + 1
    with pytest.raises(WireVersionError, match=f"version {WIRE_VERSION + 1}.*reads version {WIRE_VERSION}"):
        decode(msgspec.msgpack.encode([*tree, "a part a later version added"]))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        pickle.dumps(TextPrompt(prompt="x")),
        msgspec.msgpack.encode(["omni-requests"]),
        msgspec.msgpack.encode(["something-else", 1, []]),
        encode(TextPrompt(prompt="x"))[:-1],
    ],
    ids=["empty", "int", "pickle", "short", "magic", "truncated"],
)
def test_other_bytes_are_a_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        decode(data)


def test_any_memoryview_decodes_or_is_refused_by_name() -> None:
    # wire.md: "Whatever the bytes, the result is a record or an OmniRequestsError". A
    # strided view raised Python's BufferError, a released one its ValueError (found by
    # helper-68).
    message = np.frombuffer(encode(TextPrompt(prompt="hi")), np.uint8)
    spaced = np.zeros(2 * message.size, np.uint8)
    spaced[::2] = message
    assert decode(memoryview(spaced[::2])) == TextPrompt(prompt="hi")  # the message, strided
    with pytest.raises(WireError, match="not an omni-requests wire message"):
        decode(memoryview(np.broadcast_to(np.zeros(1, np.uint8), (10,))))
    released = memoryview(encode(TextPrompt(prompt="hi")))
    released.release()
    with pytest.raises(PromptTypeError, match="released memoryview") as caught:
        decode(released)
    assert caught.value.path == "$"


def test_sizes_and_depths_are_bounded() -> None:
    message = encode(TextPrompt(prompt="x" * 100))
    with pytest.raises(WireError, match="max_bytes"):
        decode(message, max_bytes=50)
    deep: Any = 1
    for _ in range(20):
        deep = [deep]
    nested = encode(TextPrompt(prompt="x", mm_processor_kwargs={"deep": deep}))
    assert decode(nested).mm_processor_kwargs is not None
    with pytest.raises(WireError, match="max_depth=10") as caught:
        decode(nested, max_depth=10)
    assert caught.value.path.startswith("$.mm_processor_kwargs.deep[0][0]")
    very_deep = msgspec.msgpack.encode(["omni-requests", WIRE_VERSION, [[[0]]]]).replace(
        b"\x91\x91\x91\x00", b"\x91" * 100_000 + b"\x00"
    )
    with pytest.raises(WireError):
        decode(very_deep)
    # The bounds themselves are checked (a str raised Python's own TypeError mid-read).
    for name, bad in (("max_bytes", "1"), ("max_depth", None), ("max_bytes", True), ("max_bytes", math.nan)):
        with pytest.raises(PromptTypeError, match=f"^{name}: must be a number") as caught:
            decode(message, **{name: bad})
        assert caught.value.path == name
    for fine in (np.int64(1 << 20), math.inf, 1e6):  # numpy's ints, and no limit at all
        assert decode(message, max_bytes=fine, max_depth=fine) == TextPrompt(prompt="x" * 100)


def test_images_count_their_decoded_pixels_against_max_bytes() -> None:
    # A mode 1 pixel is a bit in the message and a byte decoded: a message under
    # max_bytes decoded to 8 times its size (and keying it took about 37 times).
    bits = Image.frombytes("1", (64, 64), b"\x55" * 512)
    gray = Image.frombytes("L", (32, 16), b"\x55" * 512)  # the same 512 bytes of pixels
    for image in (bits, gray):
        assert len(encode(TextPrompt(prompt="x", multi_modal_data={"image": image}))) < 1000
    assert decode(encode(TextPrompt(prompt="x", multi_modal_data={"image": gray})), max_bytes=2000)
    with pytest.raises(WireError, match="decode to 4096 bytes of pixels, over max_bytes=2000") as caught:
        decode(encode(TextPrompt(prompt="x", multi_modal_data={"image": bits})), max_bytes=2000)
    assert caught.value.path == "$.multi_modal_data.image[0]"
    assert decode(encode(TextPrompt(prompt="x", multi_modal_data={"image": bits})), max_bytes=4200)
    two = encode(TextPrompt(prompt="x", multi_modal_data={"image": [bits, bits]}))  # counted together
    with pytest.raises(WireError, match="decode to 8192 bytes") as caught:
        decode(two, max_bytes=8000)
    assert caught.value.path == "$.multi_modal_data.image[1]"


@pytest.mark.parametrize(
    ("array", "why"),
    [
        (["|O8", [1], b"\x00" * 8], "not a plain numpy dtype"),
        (["<i4", [2, 2], b"\x00" * 15], "has 16 bytes"),
        (["<i4", [1 << 40, 1 << 40], b""], "larger than numpy and torch can hold"),
        (["<i4", [1 << 20, 1 << 20], b""], "has 4398046511104 bytes"),
        # No element, yet more dimensions than numpy can hold: it named the message ("$").
        (["|u1", [1 << 61, 1 << 61, 0], b""], "larger than numpy and torch can hold"),
        (["i4,f8", [1], b"\x00" * 12], "not a plain numpy dtype"),
    ],
)
def test_malformed_arrays_are_refused(array: list[Any], why: str) -> None:
    tree = msgspec.msgpack.decode(
        encode(TextPrompt(prompt="", multi_modal_data={"image": np.zeros((1, 1, 3))}))
    )
    tree[2][2]["multi_modal_data"][0][1][0][1:] = array
    with pytest.raises(WireError, match=why) as caught:
        decode(msgspec.msgpack.encode(tree))
    assert caught.value.path == "$.multi_modal_data.image[0]"


def test_a_tensor_too_large_to_hold_is_refused_by_name() -> None:
    torch = pytest.importorskip("torch")
    tree = msgspec.msgpack.decode(
        encode(TextPrompt(prompt="", multi_modal_data={"video": [torch.zeros(1, 2, 2, 3)]}))
    )
    tree[2][2]["multi_modal_data"][0][1][0][2:] = [[1 << 61, 1 << 61, 0], b""]
    with pytest.raises(WireError, match=r"float32 tensor of shape .* larger than numpy and torch") as caught:
        decode(msgspec.msgpack.encode(tree))
    assert caught.value.path == "$.multi_modal_data.video[0]"


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        (
            "multi_modal_data",
            [["image", [[_tag(5), "<U1", b"\xff\xff\xff\xff"]]]],
            "$.multi_modal_data.image[0]",
        ),
        ("mm_processor_kwargs", {"a": [_tag(5), ">U1", b"\x00\x11\x00\x00"]}, "$.mm_processor_kwargs.a"),
        (
            "mm_processor_kwargs",
            {"a": [_tag(4), "<U2", [2], b"a\x00\x00\x00" * 3 + b"\x00\x00\x11\x00"]},
            "$.mm_processor_kwargs.a",
        ),
    ],
    ids=["media-scalar", "option-scalar", "option-array"],
)
def test_numpy_text_beyond_unicode_is_a_wire_error_naming_its_path(field: str, value: Any, path: str) -> None:
    # Decoding such a scalar raised numpy's SystemError; such an array decoded, and
    # raised it at its first read.
    message = msgspec.msgpack.encode(
        ["omni-requests", WIRE_VERSION, [_tag(1), "text", {"prompt": "x", field: value}]]
    )
    with pytest.raises(WireError, match=r"beyond U\+10FFFF") as caught:
        decode(message)
    assert caught.value.path == path


def _repeating(record: Any, key: str, value: object, where: Any) -> bytes:
    """``record``'s message with ``key`` given twice in the map ``where(tree)``, the second
    time with ``value``: msgspec, which writes no such map, writes a stand-in, replaced."""
    tree = msgspec.msgpack.decode(encode(record))
    stand_in = key[:-1] + "\x7f"
    where(tree)[stand_in] = value
    message = msgspec.msgpack.encode(tree)
    assert message.count(msgspec.msgpack.encode(stand_in)) == 1
    return message.replace(msgspec.msgpack.encode(stand_in), msgspec.msgpack.encode(key))


_IMAGE = Image.new("P", (2, 2))
_IMAGE.info["transparency"] = 3


@pytest.mark.parametrize(
    ("record", "key", "where", "path"),
    [
        (TextPrompt(prompt="x"), "prompt", lambda t: t[2][2], "$.prompt"),
        (
            EncoderDecoderPrompt(
                encoder_prompt=TextPrompt(prompt="a"), decoder_prompt=TextPrompt(prompt="b")
            ),
            "prompt",
            lambda t: t[2][2]["decoder_prompt"][2],
            "$.decoder_prompt.prompt",
        ),
        (
            TextPrompt(prompt="x", mm_processor_kwargs={"a": [{"fps": 1}]}),
            "fps",
            lambda t: t[2][2]["mm_processor_kwargs"]["a"][0],
            "$.mm_processor_kwargs.a[0].fps",
        ),
        (
            TextPrompt(
                prompt="x", multi_modal_data={"video": (np.zeros((1, 2, 2, 3), np.uint8), {"fps": 2.0})}
            ),
            "fps",
            lambda t: t[2][2]["multi_modal_data"][0][1][0][2],
            "$.multi_modal_data.video[0][1].fps",
        ),
        (
            TextPrompt(prompt="x", multi_modal_data={"image": _IMAGE}),
            "transparency",
            lambda t: t[2][2]["multi_modal_data"][0][1][0][6],
            "$.multi_modal_data.image[0].info.transparency",
        ),
    ],
    ids=["field", "nested-field", "option", "video-metadata", "image-transparency"],
)
def test_a_key_given_twice_in_a_map_is_a_wire_error_naming_it(
    record: Any, key: str, where: Any, path: str
) -> None:
    # msgspec kept the last value silently; another reader may keep the first, so the
    # message means two things.
    message = _repeating(record, key, 0, where)
    with pytest.raises(WireError, match=f"the key '{key}' appears twice") as caught:
        decode(message)
    assert caught.value.path == path


def test_values_without_a_wire_form_name_their_path() -> None:
    record = TextPrompt(prompt="x", additional_information={"callback": {"fn": print}})
    with pytest.raises(PromptTypeError) as caught:
        encode(record)
    assert caught.value.path == "$.additional_information.callback.fn"
    with pytest.raises(OmniRequestsError):
        encode("not a record")  # type: ignore[arg-type]


def test_importing_the_core_does_not_import_msgspec() -> None:
    code = "import sys, omni_requests; assert 'msgspec' not in sys.modules; import omni_requests.wire; assert 'msgspec' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
