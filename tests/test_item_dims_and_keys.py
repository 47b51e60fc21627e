"""Items of a dimensionality vLLM refuses, ``prompt_embeds`` vLLM cannot read, and mapping
keys given twice: each refused by name when the record is built.

vLLM 0.34's verdicts on the same values (its renderer on the tiny Qwen2-VL and
Qwen2-Audio) are checked in ``tests/vllm/test_item_dims_parity.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch

from omni_requests import (
    EmbedsPrompt,
    InvalidPromptError,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
)
from omni_requests._records import fits_embeds_prompt  # private: the adapters' kind test
from omni_requests_vllm import from_vllm

META = {"fps": 1.0}


def u8(*shape: int) -> np.ndarray[Any, Any]:
    return np.zeros(shape, np.uint8)


def f32(*shape: int) -> np.ndarray[Any, Any]:
    return np.zeros(shape, np.float32)


# -- items of too few or too many dimensions (F2) --

# (modality, value, the refused field): vLLM's parser passes each on, and the model's
# processor (or vLLM's audio normalisation) fails on it after routing, naming no field.
REFUSED_DIMS: dict[str, tuple[str, Any, str]] = {
    "video (1-D array, meta)": ("video", [(u8(28), META)], "video[0][0]"),
    "video (2-D array, meta)": ("video", [(u8(28, 28), META)], "video[0][0]"),
    "video (1-D tensor, meta)": ("video", [(torch.zeros(28), META)], "video[0][0]"),
    "video (2-D tensor, meta)": ("video", [(torch.zeros(28, 28), META)], "video[0][0]"),
    "video (5-D array, meta)": ("video", [(u8(1, 2, 28, 28, 3), META)], "video[0][0]"),
    "video (5-D tensor, meta)": ("video", [(torch.zeros(1, 2, 28, 28, 3), META)], "video[0][0]"),
    "video (5-D array, meta) alone": ("video", (u8(1, 2, 28, 28, 3), META), "video[0][0]"),
    "video [4-D, 5-D]": ("video", [u8(2, 28, 28, 3), u8(1, 2, 28, 28, 3)], "video[1]"),
    "video [5-D tensor]": ("video", [torch.zeros(1, 2, 28, 28, 3)], "video[0]"),
    "video 6-D whole": ("video", u8(1, 1, 2, 28, 28, 3), "video[0]"),
    "image [5-D array]": ("image", [u8(1, 2, 28, 28, 3)], "image[0]"),
    "image [3-D, 5-D tensor]": ("image", [u8(28, 28, 3), torch.zeros(1, 2, 28, 28, 3)], "image[1]"),
    "image 6-D whole": ("image", u8(1, 1, 2, 28, 28, 3), "image[0]"),
    "audio [3-D array]": ("audio", [f32(1, 2, 1600)], "audio[0]"),
    "audio [1-D, 3-D tensor]": ("audio", [f32(1600), torch.zeros(1, 2, 1600)], "audio[1]"),
    "audio 4-D whole": ("audio", f32(1, 1, 2, 1600), "audio[0]"),
    "audio [(3-D array, 16000)]": ("audio", [(f32(1, 2, 1600), 16000)], "audio[0][0]"),
    "audio (3-D array, None)": ("audio", (f32(1, 2, 1600), None), "audio[0][0]"),
    "audio [(3-D tensor, 16000)]": ("audio", [(torch.zeros(1, 2, 1600), 16000)], "audio[0][0]"),
}

# (modality, value, items): what vLLM's renderer takes, and the record keeps.
ACCEPTED_DIMS: dict[str, tuple[str, Any, int]] = {
    "video (3-D array, meta): one frame": ("video", [(u8(28, 28, 3), META)], 1),
    "video (4-D array, meta)": ("video", [(u8(2, 28, 28, 3), META)], 1),
    "video (3-D tensor, meta)": ("video", [(torch.zeros(28, 28, 3), META)], 1),
    "video (4-D tensor, meta)": ("video", [(torch.zeros(2, 28, 28, 3), META)], 1),
    "video [4-D, 3-D]": ("video", [u8(2, 28, 28, 3), u8(28, 28, 3)], 2),
    "video 5-D whole: a list of 4-D": ("video", u8(2, 2, 28, 28, 3), 2),
    "video [2-D tensor]: an embedding": ("video", [torch.zeros(4, 8)], 1),
    "image [4-D array]: images the processor flattens": ("image", [u8(2, 28, 28, 3)], 1),
    "image [4-D tensor]": ("image", [torch.zeros(2, 28, 28, 3)], 1),
    "image 5-D whole: a list of 4-D": ("image", u8(2, 2, 28, 28, 3), 2),
    "audio [2-D array]: channels": ("audio", [f32(2, 1600)], 1),
    "audio [(2-D array, 16000)]": ("audio", [(f32(2, 1600), 16000)], 1),
    "audio [(2-D tensor, 16000)]": ("audio", [(torch.zeros(2, 1600), 16000)], 1),
    "audio 3-D array whole: a list of 2-D": ("audio", f32(2, 2, 1600), 2),
    "audio 3-D tensor whole: embedding rows": ("audio", torch.zeros(2, 4, 8), 2),
}


@pytest.mark.parametrize("name", list(REFUSED_DIMS))
def test_an_item_of_a_dimensionality_vllm_refuses_is_refused_by_name(name: str) -> None:
    modality, value, field = REFUSED_DIMS[name]
    with pytest.raises(PromptTypeError, match="-D") as info:
        TextPrompt(prompt="x", multi_modal_data={modality: value})
    assert info.value.path == f"$.multi_modal_data.{field}"
    with pytest.raises(PromptTypeError) as via_dict:  # the adapter's reading: the same refusal
        from_vllm({"prompt": "x", "multi_modal_data": {modality: value}})
    assert via_dict.value.path == info.value.path


@pytest.mark.parametrize("name", list(ACCEPTED_DIMS))
def test_items_of_the_dimensions_vllm_takes_are_kept(name: str) -> None:
    modality, value, items = ACCEPTED_DIMS[name]
    record = TextPrompt(prompt="x", multi_modal_data={modality: value})
    assert len(record.multi_modal_data[modality]) == items


def test_an_item_too_deep_names_where_a_whole_value_split_it() -> None:
    with pytest.raises(PromptTypeError, match="given whole as a list of them"):
        TextPrompt(prompt="x", multi_modal_data={"image": u8(1, 1, 2, 28, 28, 3)})
    with pytest.raises(PromptTypeError) as info:
        TextPrompt(prompt="x", multi_modal_data={"image": [u8(1, 2, 28, 28, 3)]})
    assert "given whole" not in str(info.value)


# -- prompt_embeds vLLM's renderer cannot read (F3) --


class _LyingNdim(torch.Tensor):
    @property
    def ndim(self) -> int:  # type: ignore[override]
        return 3  # vLLM's renderer reads ndim; the record reads the shape (5, 64)


class _RaisingNdim(torch.Tensor):
    @property
    def ndim(self) -> int:  # type: ignore[override]
        raise AttributeError("ndim")


def _embeds_vllm_cannot_read() -> Iterator[tuple[str, torch.Tensor, str]]:
    yield "meta", torch.empty(5, 64, device="meta"), "meta tensor"
    yield "meta, batch of one", torch.empty(1, 5, 64, device="meta"), "meta tensor"
    yield "ndim lies", torch.zeros(5, 64).as_subclass(_LyingNdim), "says ndim 3"
    yield "ndim raises", torch.zeros(5, 64).as_subclass(_RaisingNdim), "cannot be read"


@pytest.mark.parametrize(("name", "embeds", "why"), list(_embeds_vllm_cannot_read()))
def test_prompt_embeds_vllm_cannot_read_are_refused_by_name(
    name: str, embeds: torch.Tensor, why: str
) -> None:
    with pytest.raises(PromptTypeError, match=why) as info:
        EmbedsPrompt(prompt_embeds=embeds)
    assert info.value.path == "$.prompt_embeds"


def test_plain_prompt_embeds_are_kept_and_fits_embeds_prompt_stays_a_shape_test() -> None:
    for embeds in (torch.zeros(5, 64), torch.zeros(1, 5, 64), torch.zeros(5, 64, dtype=torch.bfloat16)):
        assert EmbedsPrompt(prompt_embeds=embeds).prompt_embeds is embeds
    # from_vllm decides a dict's kind by shape alone: a meta tensor of an embeds prompt's
    # shape still reads as one (and is then refused by name), not as another kind.
    meta = torch.empty(5, 64, device="meta")
    assert fits_embeds_prompt(meta)
    assert not fits_embeds_prompt(torch.empty(2, 5, 64, device="meta"))
    with pytest.raises(PromptTypeError) as info:
        from_vllm({"prompt_embeds": meta})
    assert info.value.path == "$.prompt_embeds"


# -- mapping keys given twice (F4) --


class _Key(str):
    """A str subclass compared and hashed by identity: beside the plain key of its text in
    a dict, both are kept, and both read as that text."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


class _Twice(Mapping[str, Any]):
    """A mapping whose items list one plain key twice (its own code decides what it lists)."""

    def __init__(self, key: str, first: object, second: object) -> None:
        self._entries = [(key, first), (key, second)]

    def __getitem__(self, key: str) -> Any:
        return dict(self._entries)[key]

    def __iter__(self) -> Iterator[str]:
        return iter([key for key, _ in self._entries])

    def __len__(self) -> int:
        return 2

    def items(self) -> Any:
        return list(self._entries)


def _image(value: int) -> np.ndarray[Any, Any]:
    return np.full((4, 4, 3), value, np.uint8)


def _duplicated() -> Iterator[tuple[str, dict[str, Any], str]]:
    a, b = _image(0), _image(1)
    yield "image", {"multi_modal_data": {_Key("image"): [a], "image": [b]}}, "$.multi_modal_data.image"
    yield (
        "uuids",
        {"multi_modal_data": {"image": [a]}, "multi_modal_uuids": {_Key("image"): ["u-a"], "image": ["u-b"]}},
        "$.multi_modal_uuids.image",
    )
    yield "options", {"mm_processor_kwargs": {_Key("size"): 1, "size": 2}}, "$.mm_processor_kwargs.size"
    yield (
        "nested options",
        {"mm_processor_kwargs": {"size": {_Key("h"): 1, "h": 2}}},
        "$.mm_processor_kwargs.size.h",
    )
    yield (
        "media io",
        {"multi_modal_data": {"image": [a]}, "media_io_kwargs": {_Key("image"): {}, "image": {}}},
        "$.media_io_kwargs.image",
    )
    yield "stage payload", {"additional_information": {_Key("k"): 1, "k": 2}}, "$.additional_information.k"
    yield (
        "video metadata",
        {"multi_modal_data": {"video": [(np.zeros((2, 4, 4, 3), np.uint8), {_Key("fps"): 1.0, "fps": 2.0})]}},
        "$.multi_modal_data.video[0][1].fps",
    )
    yield (
        "a mapping listing a plain key twice",
        {"multi_modal_data": _Twice("image", [a], [b])},
        "$.multi_modal_data.image",
    )


@pytest.mark.parametrize(("name", "fields", "path"), list(_duplicated()))
def test_a_key_given_twice_is_refused_by_name(name: str, fields: dict[str, Any], path: str) -> None:
    with pytest.raises(InvalidPromptError, match="is given twice") as info:
        TextPrompt(prompt="x", **fields)
    assert info.value.path == path
    with pytest.raises(InvalidPromptError) as via_dict:  # vLLM's dict form: the same refusal
        from_vllm({"prompt": "x", **fields})
    assert via_dict.value.path == path


def test_a_str_subclass_key_alone_reads_as_its_text() -> None:
    a = _image(0)
    record = TokensPrompt(
        prompt_token_ids=[1],
        multi_modal_data={_Key("image"): [a]},
        multi_modal_uuids={_Key("image"): ["u"]},
        mm_processor_kwargs={_Key("size"): 1},
    )
    assert type(next(iter(record.multi_modal_data))) is str
    assert record.multi_modal_uuids["image"][0] == "u"
    assert record.mm_processor_kwargs is not None
    assert dict(record.mm_processor_kwargs) == {"size": 1}


# -- a video pair's metadata, and a None UUID row --


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ((u8(4, 4, 3), u8(4, 4, 3)), "numpy.ndarray"),
        ([(u8(2, 4, 4, 3), 3)], "int"),
        ([(u8(2, 4, 4, 3), [1])], "list"),
    ],
    ids=["two-frames-whole", "a-number", "a-list"],
)
def test_a_video_pairs_metadata_must_be_a_mapping_or_none(value: Any, got: str) -> None:
    # vLLM unpacks any pair as (frames, metadata) (its types say a dict): two frames in a
    # tuple were kept as a one-frame video whose metadata was the second frame, which the
    # guide promised to refuse (found by a docs audit, helper-65).
    for build in (
        lambda: TextPrompt(prompt="<video>", multi_modal_data={"video": value}),
        lambda: from_vllm({"prompt": "<video>", "multi_modal_data": {"video": value}}),
    ):
        with pytest.raises(PromptTypeError, match=f"metadata must be a mapping .* got {got}") as caught:
            build()
        assert caught.value.path == "$.multi_modal_data.video[0][1]"
    for kept in ((u8(2, 4, 4, 3), None), (u8(2, 4, 4, 3), META)):
        assert (
            len(TextPrompt(prompt="<video>", multi_modal_data={"video": [kept]}).multi_modal_data["video"])
            == 1
        )


def test_a_none_uuid_row_reads_as_no_uuids_as_vllm_reads_it() -> None:
    # vLLM's parse_mm_uuids keeps a None row, and its validation and hashing read it as no
    # UUIDs (each item keyed by its content); records refused it with a message naming
    # None as allowed (found by a review, helper-63).
    from vllm.multimodal.parse import parse_mm_uuids

    assert parse_mm_uuids({"image": None}) == {"image": None}
    given = {"prompt": "<image>", "multi_modal_data": {"image": u8(4, 4, 3)}}
    plain = from_vllm(given)
    assert from_vllm({**given, "multi_modal_uuids": {"image": None}}) == plain
    record = TextPrompt(
        prompt="<image>", multi_modal_data={"image": u8(4, 4, 3)}, multi_modal_uuids={"image": None}
    )
    assert record == TextPrompt(prompt="<image>", multi_modal_data={"image": u8(4, 4, 3)})
