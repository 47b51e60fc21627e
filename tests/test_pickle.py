"""Records pickle through their constructor: values come back checked and frozen."""

from __future__ import annotations

import copy
import io
import pickle
import uuid
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pyrsistent import pvector

from omni_requests import (
    EncoderDecoderPrompt,
    KeyPolicy,
    MediaHasher,
    TextPrompt,
    TokensPrompt,
    media_keys,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests_vllm import to_vllm

from .conftest import video


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_round_trip_keeps_values_scope_and_keys(hasher: MediaHasher, protocol: int) -> None:
    p = scope_to_replica(
        TextPrompt(
            prompt="x",
            multi_modal_data={
                "video": [video(1), [video(2)[0]] * 2],
                "audio": (np.zeros(4, np.float32), 8000),
            },
            multi_modal_uuids={"audio": "a"},
            mm_processor_kwargs={"fps": 2},
        ),
        1,
        hasher=hasher,
    )
    q = pickle.loads(pickle.dumps(p, protocol))
    assert q == p
    assert q.scope == p.scope
    assert rendered_uuids(q) == rendered_uuids(p)
    assert not q.multi_modal_data["video"][0].flags.writeable


def _kept_as_given() -> list[Image.Image]:
    """Images a record keeps as given (not sealed), each with what Pillow's pickle drops."""
    indices = np.arange(24, dtype=np.uint8).reshape(4, 6) % 20
    rgba = Image.fromarray(indices, "P")
    rgba.putpalette(bytes(range(80)) + bytes(944), "RGBA")  # Pillow's pickle keeps RGB
    replaced = Image.fromarray(indices, "P")
    replaced.putpalette(bytes(range(60)) + bytes(708))
    replaced.load()
    replaced.palette.palette = bytes(range(100, 160)) + bytes(708)  # the core keeps the first
    edited = Image.fromarray(indices, "P")
    edited.putpalette(bytes(range(60)) + bytes(708))
    edited.getexif()[0x0112] = 6  # set through getexif(): Pillow's pickle drops them
    edited.getexif()[0x800D] = uuid.UUID(int=5)
    return [rgba, replaced, edited]


@pytest.mark.parametrize("modality", ["image", "thumb", "video"])
def test_images_kept_as_given_pickle_with_their_palette_and_tags(modality: str) -> None:
    # Pickled by Pillow alone these came back converting, turning or keyed otherwise: an
    # unequal record, other keys, and under bind_content other fingerprints.
    hasher = MediaHasher("m")
    items: list[Any] = (
        [[image, image] for image in _kept_as_given()] if modality == "video" else _kept_as_given()
    )
    record = TextPrompt(
        prompt="x",
        multi_modal_data={modality: pvector(items)},
        multi_modal_uuids={modality: [None, None, "clip"]},
    )
    bound = scope_to_replica(record, 1, hasher=hasher, policy=KeyPolicy(bind_content=True))
    copy = pickle.loads(pickle.dumps(bound))
    assert copy == bound
    assert rendered_uuids(copy) == rendered_uuids(bound)
    assert media_keys(copy, hasher) == media_keys(bound, hasher)


def _tiff(mode: str) -> Any:
    buffer = io.BytesIO()
    Image.fromarray(np.arange(96, dtype=np.uint8).reshape(4, 8, 3)).convert(mode).save(buffer, "TIFF")
    buffer.seek(0)
    image = Image.open(buffer)
    image.load()
    return image


def _malformed_info(image: Image.Image) -> Image.Image:
    image.info["exif"] = b"Exif\x00\x00garbage"  # after the edit: the cache holds the tag
    return image


@pytest.mark.parametrize("tag", [0x0112, 0x800D], ids=["orientation", "image-id"])
@pytest.mark.parametrize(
    "make",
    [lambda: _tiff("RGB"), lambda: _tiff("P"), lambda: Image.new("P", (8, 4))],
    ids=["tiff-rgb", "tiff-p", "p-malformed-info"],
)
def test_tags_set_where_info_cannot_give_them_back_survive_a_pickle(make: Any, tag: int) -> None:
    # A TIFF's tags come from its file, and a cache over an info["exif"] Pillow cannot
    # parse holds tags nothing else does: Pillow's pickle keeps info only, so the
    # unpickled image was unturned (or keyed without its ImageID).
    image = make()
    image.getexif()[tag] = 6 if tag == 0x0112 else uuid.UUID(int=7)
    if image.format is None:
        _malformed_info(image)
    record = TextPrompt(prompt="x", multi_modal_data={"image": image, "thumb": image})
    copy = pickle.loads(pickle.dumps(record))
    assert copy == record
    hasher = MediaHasher("m")
    assert media_keys(copy, hasher) == media_keys(record, hasher)
    assert copy.multi_modal_data["thumb"][0].getexif().get(tag) == image.getexif().get(tag)


@pytest.mark.parametrize(
    "unparsable",
    [{"xmp": 123}, {"Raw profile type exif": "not\nhex\nat\nall"}],
    ids=["xmp-int", "raw-profile"],
)
def test_tags_over_info_pillow_cannot_parse_unpickle(unparsable: dict[str, Any]) -> None:
    # The restore assumed any failed parse came from info["exif"], popped it, and
    # pickle.loads raised KeyError: a record that could be dumped but not loaded.
    image = Image.new("P", (4, 4))
    image.getexif()[0x0112] = 6
    image.info.update(unparsable)
    record = TextPrompt(prompt="x", multi_modal_data={"image": image})
    assert pickle.loads(pickle.dumps(record)) == record


def test_pickle_holds_no_pyrsistent_objects() -> None:
    p = TokensPrompt(prompt_token_ids=[1, 2], multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)})
    assert b"pyrsistent" not in pickle.dumps(p) and b"pvectorc" not in pickle.dumps(p)


def test_encoder_decoder_round_trip() -> None:
    p = EncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="a"), decoder_prompt=TextPrompt(prompt="b"))
    assert pickle.loads(pickle.dumps(p)) == p


def test_object_arrays_in_options_pickle_by_value() -> None:
    p = TextPrompt(prompt="x", additional_information={"names": np.array(["a", None], dtype=object)})
    q = pickle.loads(pickle.dumps(p))
    assert list(q.additional_information["names"]) == ["a", None]  # type: ignore[index]
    # Compared by value, not by the pointers an object array's bytes are: equal after the
    # round trip, and two equal constructions equal (both were unequal).
    assert q == p
    again = TextPrompt(prompt="x", additional_information={"names": np.array(["a", None], dtype=object)})
    assert again == p
    assert again != TextPrompt(
        prompt="x", additional_information={"names": np.array(["b", None], dtype=object)}
    )


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_option_arrays_of_a_dtype_of_no_bytes_pickle_and_deep_copy(protocol: int) -> None:
    # Rebuilt over bytes like other arrays, they pickled into bytes pickle.loads refused
    # (numpy makes no array of item size 0 over a buffer), and copy.deepcopy failed.
    empty = np.empty(3, dtype="V0")
    fields = np.zeros(2, dtype=[("a", ">i4", (0,))])
    record = TextPrompt(prompt="x", mm_processor_kwargs={"a": empty}, additional_information={"b": [fields]})
    for again in (pickle.loads(pickle.dumps(record, protocol)), copy.deepcopy(record)):
        assert again == record
        option = again.mm_processor_kwargs["a"]  # type: ignore[index]
        assert (option.dtype, option.shape) == (empty.dtype, empty.shape)
        assert again.additional_information["b"][0].dtype == fields.dtype  # type: ignore[index]


class _RaisingEquality:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing me")

    __hash__ = object.__hash__


def test_an_option_whose_equality_raises_makes_records_unequal_not_an_error() -> None:
    options = {"mode": _RaisingEquality()}
    a, b = (
        TextPrompt(prompt="x", mm_processor_kwargs=options),
        TextPrompt(prompt="x", mm_processor_kwargs=options),
    )
    assert a == b  # the same object
    assert a != TextPrompt(prompt="x", mm_processor_kwargs={"mode": _RaisingEquality()})


def test_structured_and_self_holding_object_arrays_in_options_compare_without_pointers() -> None:
    # A structured element is an np.void of pointers; an array holding itself has no end
    # to walk (the comparison raised RecursionError).
    fields = np.zeros(2, dtype=[("x", "O"), ("y", "i4")])
    fields["x"][0], fields["x"][1] = "a", "b"
    record = TextPrompt(prompt="x", mm_processor_kwargs={"a": fields})
    assert pickle.loads(pickle.dumps(record)) == record
    holding = np.empty(1, object)
    holding[0] = holding
    itself = TextPrompt(prompt="x", mm_processor_kwargs={"a": holding})
    assert itself == itself
    assert itself != pickle.loads(pickle.dumps(itself))  # an unending walk is no proof of equality


def test_copy_copy_of_a_record_is_the_record() -> None:
    # vllm-omni copies prompts (copy.copy) before a model's prompt transform; copy.copy
    # used to rebuild a record from __reduce__'s pickle-only wrappers and failed (media
    # arrays, unsealed images) or carried a wrapper into the engine's dict (options).
    cmyk = Image.new("CMYK", (4, 4))  # kept as given, not sealed
    record = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [np.zeros((2, 2, 3), np.uint8), cmyk]},
        additional_information={"speaker": np.arange(3)},
    )
    pair = EncoderDecoderPrompt(encoder_prompt=record, decoder_prompt=record)
    for prompt in (record, scope_to_replica(record, 1, hasher=MediaHasher("m")), pair):
        assert copy.copy(prompt) is prompt
        assert copy.deepcopy(prompt) == prompt
    sent = to_vllm(copy.copy(record))
    assert isinstance(sent["additional_information"]["speaker"], np.ndarray)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_unsigned_tensors_torch_cannot_pickle_pickle_with_their_dtype_and_key(
    dtype: str, protocol: int
) -> None:
    # torch (2.14) has no typed storage for these, and its pickle raised AttributeError.
    torch = pytest.importorskip("torch")
    big = torch.full((3, 2), 40_000, dtype=torch.int64).to(getattr(torch, dtype))
    record = TextPrompt(
        prompt="x",
        # An empty tensor is no image (no pixels): a custom modality holds it.
        multi_modal_data={"image": [big, big.T], "mask": [torch.zeros((0, 2), dtype=big.dtype)]},
        mm_processor_kwargs={"mask": big},  # an option: the caller's tensor, kept as given
    )
    again = pickle.loads(pickle.dumps(record, protocol))
    assert again == record
    hasher = MediaHasher("m")
    assert media_keys(again, hasher) == media_keys(record, hasher)
    option = again.mm_processor_kwargs["mask"]  # type: ignore[index]
    assert option.dtype == big.dtype and option.shape == big.shape and torch.equal(option, big)


def test_a_record_holding_rows_of_a_grad_requiring_tensor_deep_copies_as_it_pickles() -> None:
    # A grad-requiring tensor is kept as given, each row a view that is no leaf of torch's
    # graph; torch pickles such a view (as a leaf) but refuses to deep-copy it, so
    # copy.deepcopy of the record raised torch's autograd error, naming no field, where the
    # caller's own tensor deep-copies (found by a review, helper-78). vllm-omni
    # deep-copies a request's prompt (its request snapshots).
    torch = pytest.importorskip("torch")
    given = torch.rand(2, 4, 4, 3, requires_grad=True)
    record = TextPrompt(
        prompt="x", multi_modal_data={"image": given}, mm_processor_kwargs={"w": given[0] * 2}
    )
    hasher = MediaHasher("m")
    for again in (copy.deepcopy(record), pickle.loads(pickle.dumps(record))):
        assert again == record and media_keys(again, hasher) == media_keys(record, hasher)
        rows, held = again.multi_modal_data["image"], record.multi_modal_data["image"]
        assert all(row.is_leaf and row.requires_grad for row in rows)
        assert all(row.data_ptr() != old.data_ptr() for row, old in zip(rows, held, strict=True))  # copies
        option = again.mm_processor_kwargs["w"]  # type: ignore[index]
        assert option.is_leaf and option.requires_grad and torch.equal(option, given[0] * 2)
    assert given.grad is None and given.is_leaf  # the caller's tensor as it was


class _SharedBytes:
    """Unpickles as a record's array over ``shared``, a bytearray the same pickle also
    returns: what a crafted pickle can do through the records' own restore function."""

    def __init__(self, shared: bytearray) -> None:
        self.shared = shared

    def __reduce__(self) -> Any:
        from omni_requests import _records

        return (_records._restore_array, (np.dtype(np.uint8), (4, 4, 3), self.shared))


def test_a_crafted_pickle_cannot_give_a_record_an_array_over_bytes_it_shares() -> None:
    # The restore function took what it was given as bytes only the unpickler held: a
    # bytearray (protocol 5 makes one with no global) shared with another object of the
    # pickle became a writable array the record kept as its own, its key cached (found
    # by an adversarial review). It is now copied into bytes of the record's own.
    shared = bytearray(48)
    record = TextPrompt(prompt="x", multi_modal_data={"image": [np.zeros((4, 4, 3), np.uint8)]})
    restore, (kind, fields) = record.__reduce__()  # type: ignore[misc]
    fields["multi_modal_data"]["image"][0] = _SharedBytes(shared)
    (restore, kind, fields), handle = pickle.loads(
        pickle.dumps(((restore, kind, fields), shared), protocol=5)
    )
    scoped = scope_to_replica(restore(kind, fields), 0, hasher=MediaHasher("m"))
    array = scoped.multi_modal_data["image"][0]
    first = to_vllm(scoped)["multi_modal_uuids"]["image"][0]
    handle[:] = b"\x07" * 48
    assert not array.flags.writeable and not array.any()
    assert to_vllm(scoped)["multi_modal_uuids"]["image"][0] == first
    assert first == "stage0:rep0:" + MediaHasher("m").key("image", np.zeros((4, 4, 3), np.uint8))
