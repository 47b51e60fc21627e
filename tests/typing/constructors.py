"""Type-checked in CI (mypy --strict): what the record constructors accept, and the types
the records' fields reveal.

Each function is one example. ``tests/test_typing_examples.py`` also runs them, so what
mypy accepts here the constructors accept at run time, and each returns the kind it says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, assert_type

import attrs
import numpy as np
from pyrsistent import PMap, PVector, pvector

from omni_requests import EmbedsPrompt, EncoderDecoderPrompt, FrozenDict, TextPrompt, TokensPrompt

if TYPE_CHECKING:
    import torch


def text_with_every_kind_of_media() -> TextPrompt:
    image = np.zeros((4, 4, 3), np.uint8)
    frames = [np.zeros((4, 4, 3), np.uint8) for _ in range(3)]
    record = TextPrompt(
        prompt="<image><image><video><audio>",
        multi_modal_data={
            "image": [image, None],  # None: an item its UUID names (cached by the engine)
            "video": frames,  # one video, given as its frames
            "audio": (np.zeros(16, np.float32), 16000),  # (waveform, sampling rate)
        },
        multi_modal_uuids={"image": [None, "cat-1"]},
        mm_processor_kwargs={"size": {"shortest_edge": 8}},
        media_io_kwargs={"video": {"num_frames": 3}},
        cache_salt="tenant-a",
        negative_prompt="blurry",
        additional_information={"speaker": "a"},
        modalities=["text"],
    )
    assert_type(record.prompt, str)
    assert_type(record.negative_prompt, str | None)
    assert_type(record.multi_modal_data, PMap[str, PVector[Any]])
    assert_type(record.multi_modal_uuids, PMap[str, PVector[str | None]])
    assert_type(record.mm_processor_kwargs, FrozenDict[str, Any] | None)
    assert_type(record.cache_salt, str | None)
    assert_type(record.modalities, PVector[str] | None)
    return record


def media_from_typed_variables(
    images: list[np.ndarray[tuple[int, int, int], np.dtype[np.uint8]]],
    uuids: dict[str, list[str]],
    options: dict[str, int],
) -> TextPrompt:
    # Mappings and sequences are read-only parameters, so narrower values fit.
    return TextPrompt(
        prompt="<image>" * len(images),
        multi_modal_data={"image": images},
        multi_modal_uuids=uuids,
        mm_processor_kwargs=options,
    )


def tokens_from_a_list_a_tuple_or_an_array() -> TokensPrompt:
    from_list = TokensPrompt(prompt_token_ids=[1, 2, 3], token_type_ids=[0, 0, 1])
    from_tuple = TokensPrompt(prompt_token_ids=(1, 2, 3))
    from_array = TokensPrompt(prompt_token_ids=np.array([1, 2, 3], np.int64))
    assert_type(from_array.prompt_token_ids, PVector[int])
    assert_type(from_list.token_type_ids, PVector[int] | None)
    assert from_list.prompt_token_ids == from_tuple.prompt_token_ids == from_array.prompt_token_ids
    return from_list


def tokens_from_a_sequence(ids: Sequence[int]) -> TokensPrompt:
    return TokensPrompt(prompt_token_ids=ids)


def copies_take_the_records_own_values() -> TextPrompt:
    # attrs.evolve passes a record's frozen values back through the constructor.
    template = TextPrompt(prompt="<image>", multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)})
    copy = attrs.evolve(template, prompt="<image> again", multi_modal_data=template.multi_modal_data)
    assert_type(copy, TextPrompt)
    # A pvector is a list of items already: never split again.
    return TextPrompt(
        prompt="<image>", multi_modal_data={"image": pvector(template.multi_modal_data["image"])}
    )


def uuids_as_a_string_or_a_list(uuids: Mapping[str, str | Sequence[str | None]]) -> TextPrompt:
    return TextPrompt(prompt="<image>", multi_modal_uuids=uuids)


def pil_images() -> TextPrompt:
    from PIL import Image

    picture = Image.new("RGB", (4, 4))
    return TextPrompt(
        prompt="<image><video>", multi_modal_data={"image": picture, "video": [picture, picture]}
    )


def embeddings(embeds: torch.Tensor) -> EmbedsPrompt:
    record = EmbedsPrompt(prompt_embeds=embeds, negative_prompt_embeds=[embeds])
    TextPrompt(prompt="<image>", multi_modal_data={"image": [embeds]})  # tensors are media items too
    negative = TokensPrompt(prompt_token_ids=[1], negative_prompt_embeds=embeds)
    assert_type(negative.prompt_token_ids, PVector[int])
    return record


def encoder_decoder() -> EncoderDecoderPrompt:
    pair = EncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="a"), decoder_prompt=None)
    assert_type(pair.encoder_prompt, TextPrompt | TokensPrompt | EmbedsPrompt)
    return pair
