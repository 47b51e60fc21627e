"""Type-checked in CI (mypy --strict): ``from_vllm`` gives the record kind its input says.

A str gives a TextPrompt, a list of token ids a TokensPrompt, each of vLLM's prompt
TypedDicts its own kind, anything else the union. ``tests/test_typing_examples.py`` runs
these functions and checks that each returns, at run time, the kind mypy reveals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, assert_type

import numpy as np

from omni_requests import EmbedsPrompt, EncoderDecoderPrompt, Prompt, TextPrompt, TokensPrompt
from omni_requests_vllm import from_vllm, to_vllm

if TYPE_CHECKING:
    import torch
    from vllm.inputs import EmbedsPrompt as VllmEmbedsPrompt
    from vllm.inputs import ExplicitEncoderDecoderPrompt
    from vllm.inputs import TextPrompt as VllmTextPrompt
    from vllm.inputs import TokensPrompt as VllmTokensPrompt


def from_a_str() -> TextPrompt:
    return assert_type(from_vllm("a cat"), TextPrompt)


def from_token_ids() -> TokensPrompt:
    return assert_type(from_vllm([1, 2, 3]), TokensPrompt)


def from_vllms_text_prompt() -> TextPrompt:
    prompt: VllmTextPrompt = {
        "prompt": "<image>",
        "multi_modal_data": {"image": np.zeros((2, 2, 3), np.uint8)},
    }
    return assert_type(from_vllm(prompt), TextPrompt)


def from_vllms_tokens_prompt() -> TokensPrompt:
    prompt: VllmTokensPrompt = {"prompt_token_ids": [1, 2], "prompt": "ab"}
    return assert_type(from_vllm(prompt), TokensPrompt)


def from_a_dict_literal() -> TokensPrompt:
    # Checked against the TypedDicts in order: a literal with token ids is no TextPrompt.
    return assert_type(from_vllm({"prompt": "ab", "prompt_token_ids": [1, 2]}), TokensPrompt)


def from_vllms_embeds_prompt(embeds: torch.Tensor) -> EmbedsPrompt:
    prompt: VllmEmbedsPrompt = {"prompt_embeds": embeds, "prompt_token_ids": [1, 2]}
    return assert_type(from_vllm(prompt), EmbedsPrompt)


def from_vllms_encoder_decoder_prompt() -> EncoderDecoderPrompt:
    prompt: ExplicitEncoderDecoderPrompt = {"encoder_prompt": "a cat", "decoder_prompt": [1]}
    return assert_type(from_vllm(prompt), EncoderDecoderPrompt)


def round_trip(record: TokensPrompt) -> TokensPrompt:
    return assert_type(from_vllm(to_vllm(record)), TokensPrompt)


def from_a_request_body(body: Mapping[str, object]) -> Prompt:
    # Any mapping: the kind is only known at run time (then checked like every input).
    return assert_type(from_vllm(body), Prompt)


def from_untrusted_json(text: str) -> Prompt:
    # json.loads returns Any, and mypy gives Any back for an Any argument that several
    # overloads take: say what it is, and the union comes back.
    data: object = json.loads(text)
    assert_type(from_vllm(json.loads(text)), Any)
    return assert_type(from_vllm(data), Prompt)


def from_a_plain_dict(fields: dict[str, Any]) -> Prompt:
    return assert_type(from_vllm(fields), Prompt)
