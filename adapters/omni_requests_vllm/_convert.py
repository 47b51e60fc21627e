"""Records to vLLM prompt dicts and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypeAlias, overload

import attrs
import numpy as np

from omni_requests import (
    EmbedsPrompt,
    EncoderDecoderPrompt,
    InvalidPromptError,
    OmniRequestsError,
    Prompt,
    PromptTypeError,
    SinglePrompt,
    TextPrompt,
    TokensPrompt,
    rendered_uuids,
)
from omni_requests._errors import type_name
from omni_requests._media import plain_map, thaw

__all__ = ["VllmPrompt", "from_vllm", "to_vllm"]

VllmPrompt: TypeAlias = dict[str, Any]
"""A vLLM prompt dict (``TextPrompt``, ``TokensPrompt``, ``EmbedsPrompt`` or
``ExplicitEncoderDecoderPrompt``; vllm-omni's ``Omni*Prompt`` where omni fields are set)."""

_SINGLE: Final = (TextPrompt, TokensPrompt, EmbedsPrompt)
# Record fields that are not vLLM keys: the scope is rendered into the UUIDs.
_NOT_DICT_KEYS: Final = frozenset({"scope"})


def _dict_keys(kind: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(kind) if f.name not in _NOT_DICT_KEYS)


_KEYS: Final = {kind: _dict_keys(kind) for kind in _SINGLE}
# Fields go out main field first, like the dicts people write.
_MAIN: Final = {TextPrompt: "prompt", TokensPrompt: "prompt_token_ids", EmbedsPrompt: "prompt_embeds"}
_MEDIA: Final = ("multi_modal_data", "multi_modal_uuids")
# The other fields, in field order; they go out only when set.
_OPTIONS: Final = {
    kind: tuple(k for k in _KEYS[kind] if k != _MAIN[kind] and k not in _MEDIA) for kind in _SINGLE
}
# Values thaw() returns as they are: skip the call (to_vllm is on every request's path).
_AS_IS: Final = frozenset({str, bytes, int, float, bool, type(None), np.ndarray})


@overload
def to_vllm(prompt: SinglePrompt) -> VllmPrompt: ...
@overload
def to_vllm(prompt: EncoderDecoderPrompt) -> VllmPrompt: ...
def to_vllm(prompt: Prompt) -> VllmPrompt:
    """The vLLM prompt dict for ``prompt``, with its media keys rendered.

    Only fields that are set appear. Lists, dicts and tuples are fresh plain objects
    each call, so the engine may change them without reaching the record; arrays are
    the record's read-only views (no copy), tensors and images the record's own.
    """
    if isinstance(prompt, EncoderDecoderPrompt):
        decoder = prompt.decoder_prompt
        return {
            "encoder_prompt": _single_to_vllm(prompt.encoder_prompt),
            "decoder_prompt": None if decoder is None else _single_to_vllm(decoder),
        }
    if not isinstance(prompt, _SINGLE):
        raise PromptTypeError("prompt", f"must be a prompt record, got {type_name(prompt)}")
    return _single_to_vllm(prompt)


def _single_to_vllm(prompt: SinglePrompt) -> VllmPrompt:
    kind = type(prompt)
    main = _MAIN[kind]
    value = getattr(prompt, main)
    out: VllmPrompt = {main: value if type(value) in _AS_IS else thaw(value)}
    data = plain_map(prompt.multi_modal_data)
    if data:
        out["multi_modal_data"] = {
            m: [item if type(item) in _AS_IS else thaw(item) for item in items] for m, items in data.items()
        }
    uuids = rendered_uuids(prompt)
    if uuids is not None:
        out["multi_modal_uuids"] = uuids
    for name in _OPTIONS[kind]:
        value = getattr(prompt, name)
        if value is not None:
            out[name] = value if type(value) in _AS_IS else thaw(value)
    return out


def from_vllm(prompt: object) -> Prompt:
    """The record for a vLLM prompt (a str, a list of token ids, or a prompt dict).

    The kind follows vLLM's own rule (embeddings, then tokens, then text), falling back
    to a kind that has every given key for vllm-omni's dicts. Every value is checked
    before a record is built; the error names the field, e.g.
    ``$.multi_modal_uuids.image[1]``. The input is never changed.
    """
    if isinstance(prompt, Mapping) and "encoder_prompt" in prompt:
        unknown = sorted(set(prompt) - {"encoder_prompt", "decoder_prompt"})
        if unknown:
            raise InvalidPromptError(f"$.{unknown[0]}", "unknown field for an encoder-decoder prompt")
        encoder = _nested(prompt["encoder_prompt"], "$.encoder_prompt")
        decoder_value = prompt.get("decoder_prompt")
        decoder = None if decoder_value is None else _nested(decoder_value, "$.decoder_prompt")
        return EncoderDecoderPrompt(encoder_prompt=encoder, decoder_prompt=decoder)
    return _single_from_vllm(prompt)


def _nested(value: object, path: str) -> SinglePrompt:
    try:
        return _single_from_vllm(value)
    except OmniRequestsError as error:
        raise type(error)(path + error.path[1:], error.message) from None


def _single_from_vllm(prompt: object) -> SinglePrompt:
    if isinstance(prompt, str):
        return TextPrompt(prompt=prompt)
    if isinstance(prompt, list):
        return TokensPrompt(prompt_token_ids=prompt)
    if not isinstance(prompt, Mapping):
        raise PromptTypeError(
            "$", f"a prompt must be a str, a list of token ids or a dict, got {type_name(prompt)}"
        )
    for key in prompt:
        if not isinstance(key, str):
            raise PromptTypeError("$", f"prompt keys must be str, got {type_name(key)}")
    kind = _kind_of(prompt)
    unknown = [key for key in prompt if key not in _KEYS[kind]]
    if unknown:
        raise InvalidPromptError(
            f"$.{unknown[0]}", f"unknown field for a {kind.__name__}; known fields: {', '.join(_KEYS[kind])}"
        )
    if "encoder_prompt" in prompt:
        raise InvalidPromptError("$.encoder_prompt", "encoder-decoder prompts cannot be nested")
    return kind(**{key: value for key, value in prompt.items()})


def _kind_of(prompt: Mapping[str, object]) -> type[SinglePrompt]:
    candidates: list[type[SinglePrompt]] = []
    if "prompt_embeds" in prompt:
        candidates.append(EmbedsPrompt)
    if "prompt_token_ids" in prompt:
        candidates.append(TokensPrompt)
    if "prompt" in prompt:
        candidates.append(TextPrompt)
    if not candidates:
        raise InvalidPromptError(
            "$", "a prompt dict must contain 'prompt', 'prompt_token_ids' or 'prompt_embeds'"
        )
    for kind in candidates:
        if all(key in _KEYS[kind] for key in prompt):
            return kind
    return candidates[0]
