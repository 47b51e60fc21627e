"""Type-checked in CI (mypy --strict): calls mypy must reject.

Each mistake carries ``# type: ignore[<code>]``, and strict mode warns about an ignore
that is not needed: a mistake that stops being rejected fails mypy. The constructors
check the same values at run time, for callers without a type checker:
``tests/test_typing_examples.py`` runs every function in :data:`REJECTED_AT_RUN_TIME`
and expects our errors.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

from omni_requests import EmbedsPrompt, TextPrompt, TokensPrompt
from omni_requests_vllm import from_vllm

_IMAGE = np.zeros((2, 2, 3), np.uint8)


def prompt_is_not_text() -> None:
    TextPrompt(prompt=123)  # type: ignore[arg-type]


def a_path_is_not_an_image() -> None:
    # A custom modality may take a str; an image, video or audio may not (vLLM's parser
    # reads its characters as items). Load the file first.
    TextPrompt(prompt="<image>", multi_modal_data={"image": "cat.jpg"})  # type: ignore[dict-item]


def media_is_not_a_mapping() -> None:
    TextPrompt(prompt="x", multi_modal_data=42)  # type: ignore[arg-type]


def modality_names_are_str() -> None:
    TextPrompt(prompt="x", multi_modal_data={1: _IMAGE})  # type: ignore[dict-item]


def a_modality_is_not_none() -> None:
    TextPrompt(prompt="x", multi_modal_data={"image": None})  # type: ignore[dict-item]


def an_item_is_not_a_set() -> None:
    TextPrompt(prompt="x", multi_modal_data={"image": {1, 2}})  # type: ignore[dict-item]


def uuids_are_str() -> None:
    TextPrompt(prompt="x", multi_modal_data={"image": _IMAGE}, multi_modal_uuids={"image": 7})  # type: ignore[dict-item]


def uuid_lists_hold_str_or_none() -> None:
    TextPrompt(
        prompt="x",
        multi_modal_data={"image": [_IMAGE, _IMAGE]},
        multi_modal_uuids={"image": [None, 3]},  # type: ignore[list-item]
    )


def token_ids_are_not_text() -> None:
    TokensPrompt(prompt_token_ids="1 2 3")  # type: ignore[arg-type]


def token_ids_are_ints() -> None:
    TokensPrompt(prompt_token_ids=[1.0, 2.0])  # type: ignore[list-item]


def token_ids_are_not_a_float_array() -> None:
    TokensPrompt(prompt_token_ids=np.zeros(3))  # type: ignore[arg-type]


def token_type_ids_are_ints() -> None:
    TokensPrompt(prompt_token_ids=[1], token_type_ids=["a"])  # type: ignore[list-item]


def modalities_are_a_list() -> None:
    TextPrompt(prompt="x", modalities="image")  # type: ignore[arg-type]


def options_are_a_mapping() -> None:
    TextPrompt(prompt="x", mm_processor_kwargs=[("size", 8)])  # type: ignore[arg-type]


def media_io_kwargs_map_modalities_to_options() -> None:
    TextPrompt(prompt="x", media_io_kwargs={"video": 8})  # type: ignore[dict-item]


def the_salt_is_text() -> None:
    TextPrompt(prompt="x", cache_salt=1)  # type: ignore[arg-type]


def the_negative_prompt_is_text() -> None:
    TextPrompt(prompt="x", negative_prompt=b"blurry")  # type: ignore[arg-type]


def embeddings_are_a_tensor() -> None:
    EmbedsPrompt(prompt_embeds=np.zeros((2, 4)))  # type: ignore[arg-type]


def copies_are_checked_too() -> None:
    attrs.evolve(TextPrompt(prompt="x"), prompt=1)  # type: ignore[arg-type]


def a_prompt_is_not_a_number() -> None:
    TokensPrompt(prompt_token_ids=[1], prompt=2)  # type: ignore[arg-type]


REJECTED_AT_RUN_TIME: tuple[Callable[[], None], ...] = (
    prompt_is_not_text,
    media_is_not_a_mapping,
    a_path_is_not_an_image,
    modality_names_are_str,
    a_modality_is_not_none,
    an_item_is_not_a_set,
    uuids_are_str,
    uuid_lists_hold_str_or_none,
    token_ids_are_not_text,
    token_ids_are_ints,
    token_ids_are_not_a_float_array,
    token_type_ids_are_ints,
    modalities_are_a_list,
    options_are_a_mapping,
    media_io_kwargs_map_modalities_to_options,
    the_salt_is_text,
    the_negative_prompt_is_text,
    embeddings_are_a_tensor,
    copies_are_checked_too,
    a_prompt_is_not_a_number,
)


# -- mistakes only a type checker sees: the values are valid, the code is wrong --


def encoded_bytes_are_not_an_image() -> TextPrompt:
    return TextPrompt(prompt="<image>", multi_modal_data={"image": b"\xff\xd8\xff"})  # type: ignore[dict-item]


def text_does_not_give_tokens() -> TokensPrompt:
    return from_vllm("a cat")  # type: ignore[return-value]


def token_ids_do_not_give_text() -> TextPrompt:
    return from_vllm([1, 2, 3])  # type: ignore[return-value]


def a_vllm_dict_gives_its_own_kind() -> TokensPrompt:
    return from_vllm({"prompt": "a cat"})  # type: ignore[return-value]
