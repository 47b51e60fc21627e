"""The chat path through vLLM's own chat code: parse, template and tokenize as vLLM does.

:func:`chat_with_vllm` does what vLLM's ``LLM.chat`` does before the engine
(``vllm.entrypoints.common.offline``'s ``_preprocess_chat``): the same ``ChatParams``,
``renderer.render_messages`` (vLLM's parser, media connector and chat template), and
the renderer's tokenizer with ``add_special_tokens=False``. It stops where vLLM hands the
prompt to ``process_for_engine`` and turns that prompt into a record instead, so
``to_vllm(record)`` fed to the same renderer gives vLLM's own token ids, placeholders and
``mm_hashes``, and scoping the record gives ``stage0:rep{R}:<vLLM's own chat key>``.
Two steps of vLLM's own processing are taken early, so the record's keys are vLLM's:
chat audio is held as vLLM's parser resamples it (vLLM keys that waveform, not the
decoded ``(waveform, rate)``), and embeddings given as dicts, which vLLM merges into one
dict per modality, are held as vLLM's parser splits that dict (one
``EmbeddingFields`` per item), which ``to_vllm`` merges back.

vLLM is imported only when this runs (the adapter stays importable without it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from omni_requests import (
    InvalidPromptError,
    OmniRequestsError,
    PromptTypeError,
    TokensPrompt,
)
from omni_requests._adapter_api import EmbeddingFields, type_name

from ._loaders import MediaLoadError

__all__ = ["chat_with_vllm"]

_ROOT: Final = "$.messages"

# Content part type -> the modality vLLM files its item under (parse order = item order).
_PART_MODALITY: Final = {
    "image_url": "image",
    "input_image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}
# An error of from_vllm about one item, or (no index) about a whole modality.
_ITEM_PATH: Final = re.compile(r"^\$\.multi_modal_(?:data|uuids)\.(\w+)(?:\[(\d+)\])?(.*)$")


def _copied(value: object) -> object:
    """The JSON-like structure of ``value`` copied (dicts and lists), leaves shared.

    vLLM writes into the messages it is given (an assistant's tool-call ``arguments``
    are parsed in place); the caller's messages must not change.
    """
    if isinstance(value, Mapping):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return value


def checked_roles(messages: object) -> Iterator[tuple[str, Mapping[str, Any], str]]:
    """Each message with its path and role, after the checks both chat paths make first:
    a list of message objects, each with a non-empty str role."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise PromptTypeError(_ROOT, f"must be a list of message objects, got {type_name(messages)}")
    for m, message in enumerate(messages):
        where = f"{_ROOT}[{m}]"
        if not isinstance(message, Mapping):
            raise PromptTypeError(where, f"must be a message object, got {type_name(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidPromptError(f"{where}.role", f"must be a non-empty str, got {role!r}")
        yield where, message, role


def part_uuid(part: Mapping[str, Any], path: str) -> str | None:
    """A part's uuid as vLLM reads it (``str(uuid)``), checked on both chat paths.

    vLLM keys the item by ``str(uuid)`` whatever the value: only a str or an int is taken,
    since other values can print alike while they differ (a large numpy array's summary,
    an object's address reused by the next request). An empty one is refused: vLLM would
    key every such item ``""``, one cache entry for all of them.
    """
    uuid = part.get("uuid")
    if uuid is None:
        return None
    if not isinstance(uuid, (str, int)) or isinstance(uuid, bool):
        raise PromptTypeError(
            f"{path}.uuid",
            f"must be a str (or an int, which vLLM reads as its str), got {type_name(uuid)}: vLLM keys "
            "the item by str(uuid), which for other values can be the same text for different ones",
        )
    try:
        text = str(uuid)
    except ValueError:  # an int past Python's limit on int-to-str conversion (4,300 digits)
        raise InvalidPromptError(
            f"{path}.uuid", f"an int of {int(uuid).bit_length()} bits is too long to read as text; give a str"
        ) from None
    if not text:
        raise InvalidPromptError(f"{path}.uuid", "must not be empty: every item needs its own key")
    return text


def _checked_messages(messages: object) -> list[dict[str, Any]]:
    """The messages copied, after the checks whose failure vLLM reports without a place."""
    out: list[dict[str, Any]] = []
    for where, message, _ in checked_roles(messages):
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise PromptTypeError(
                f"{where}.content", f"must be a str, a list of parts or null, got {type_name(content)}"
            )
        for p, part in enumerate(content if isinstance(content, (list, tuple)) else ()):
            if not isinstance(part, (Mapping, str)):
                raise PromptTypeError(
                    f"{where}.content[{p}]", f"must be a content part object or a str, got {type_name(part)}"
                )
            if isinstance(part, Mapping):
                part_uuid(part, f"{where}.content[{p}]")
            if isinstance(part, Mapping) and part.get("type") == "prompt_embeds":
                raise InvalidPromptError(
                    f"{where}.content[{p}]",
                    "prompt_embeds parts are not supported: records carry media, not prompt embeddings",
                )
        copied = _copied(message)
        assert isinstance(copied, dict)
        if isinstance(copied.get("content"), tuple):  # vLLM iterates a tuple as a list of parts
            copied["content"] = list(copied["content"])
        out.append(copied)
    return out


def _chat_params(
    renderer: Any,
    *,
    chat_template: str | None,
    chat_template_content_format: str,
    chat_template_kwargs: Mapping[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    media_io_kwargs: Mapping[str, Mapping[str, Any]] | None,
    mm_processor_kwargs: Mapping[str, Any] | None,
) -> Any:
    """vLLM's ``ChatParams`` exactly as ``LLM.chat`` builds them (plus ``media_io_kwargs``)."""
    from vllm.renderers import ChatParams, merge_kwargs
    from vllm.utils.mistral import is_mistral_tokenizer

    return ChatParams(
        chat_template=chat_template,
        chat_template_content_format=chat_template_content_format,  # type: ignore[arg-type]
        chat_template_kwargs=merge_kwargs(
            None if chat_template_kwargs is None else dict(chat_template_kwargs),
            dict(
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=None if tools is None else [dict(tool) for tool in tools],
                tokenize=(
                    is_mistral_tokenizer(renderer.tokenizer)
                    or bool(renderer.model_config.enable_prompt_embeds)
                ),
            ),
        ),
        media_io_kwargs=None
        if media_io_kwargs is None
        else {modality: dict(options) for modality, options in media_io_kwargs.items()},
        mm_processor_kwargs=None if mm_processor_kwargs is None else dict(mm_processor_kwargs),
    )


def _refusal(messages: list[dict[str, Any]], where: str, error: BaseException) -> OmniRequestsError:
    """vLLM's refusal of the part (or message) at ``where`` as our error, its message kept."""
    from vllm.exceptions import VLLMValidationError

    part = _at(messages, where)

    text = f"vLLM refuses it: {type(error).__name__}: {error}"
    if isinstance(error, OmniRequestsError):
        return error.under(where)
    if isinstance(error, TypeError):
        return PromptTypeError(where, text)
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in _PART_MODALITY and not isinstance(error, VLLMValidationError):
        return MediaLoadError(where, text)  # the media could not be fetched or decoded
    return InvalidPromptError(where, text)


def _locate(renderer: Any, messages: list[dict[str, Any]], params: Any) -> str:
    """Where vLLM's parser first fails: ``$.messages[m].content[p]``, else the message, else ``$.messages``.

    Re-parses growing prefixes of the conversation with vLLM's own ``parse_chat_messages``
    (only after a failure), so cross-part refusals (too many items, raw media mixed with
    embeddings) are pinned on the part that crossed the line.
    """
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format

    try:
        content_format = resolve_chat_template_content_format(
            chat_template=params.chat_template,
            tools=params.chat_template_kwargs.get("tools"),
            given_format=params.chat_template_content_format,
            tokenizer=renderer.get_tokenizer(),
            model_config=renderer.model_config,
        )
    except Exception:  # noqa: BLE001 - then the template itself is the problem
        return _ROOT

    def fails(prefix: list[dict[str, Any]]) -> bool:
        try:
            parse_chat_messages(
                _copied(prefix),  # type: ignore[arg-type]
                renderer.model_config,
                content_format,
                media_io_kwargs=params.media_io_kwargs,
                mm_processor_kwargs=params.mm_processor_kwargs,
            )
        except Exception:  # noqa: BLE001 - any refusal counts
            return True
        return False

    for m, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for p in range(len(content)):
                if fails([*messages[:m], {**message, "content": content[: p + 1]}]):
                    return f"{_ROOT}[{m}].content[{p}]"
        if fails(messages[: m + 1]):
            return f"{_ROOT}[{m}].tool_calls" if message.get("tool_calls") else f"{_ROOT}[{m}]"
    return _ROOT


def _at(messages: list[dict[str, Any]], where: str) -> object:
    """The part at ``$.messages[m].content[p]`` (None for other paths)."""
    found = re.fullmatch(r"\$\.messages\[(\d+)\]\.content\[(\d+)\]", where)
    if found is None:
        return None
    content = messages[int(found.group(1))].get("content")
    return content[int(found.group(2))] if isinstance(content, list) else None


def at_part(error: OmniRequestsError, paths: Mapping[str, Sequence[str]]) -> OmniRequestsError:
    """``error`` at the chat part behind the item it names (``paths``: per modality, each
    item's part), or as it is; an error about a whole modality names its first part."""
    found = _ITEM_PATH.match(error.path)
    parts = paths.get(found.group(1), ()) if found else ()
    index = int(found.group(2) or 0) if found else 0
    if found and index < len(parts):
        return type(error)(parts[index] + found.group(3), error.message)
    return error


def _part_paths(messages: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per modality, the path of the part behind each item, in vLLM's item order."""
    paths: dict[str, list[str]] = {}
    for m, message in enumerate(messages):
        content = message.get("content")
        for p, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, Mapping):
                continue
            kind = part.get("type")
            if kind is None or part.get("uuid") is not None:
                kind = next((name for name in _PART_MODALITY if name in part), kind)
            modality = _PART_MODALITY.get(kind) if isinstance(kind, str) else None
            if modality is not None:
                paths.setdefault(modality, []).append(f"{_ROOT}[{m}].content[{p}]")
    return paths


def _as_parsed(renderer: Any, data: Mapping[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat's media as vLLM's parser hands it to the processor and the hasher, where that differs.

    vLLM's chat path loads audio as ``(waveform, rate)``; its parser resamples that to the
    model's rate and vLLM keys the resampled waveform. The record holds that waveform (a
    1-D array vLLM's parser passes through unchanged), so the record renders the same and
    its key is vLLM's chat key. Embedding parts given as dicts (``image_embeds`` with
    ``image_grid_thw``) are merged by vLLM into one dict for the whole modality; vLLM's
    parser splits that dict into items by the model's field config, and the record holds
    those items as ``EmbeddingFields`` (see :func:`_embedding_items`).
    """
    paths = _part_paths(messages)
    out = dict(data)
    info = None
    for modality, value in data.items():
        where = paths.get(modality, [])
        if isinstance(value, Mapping):
            try:
                info = info or renderer.get_mm_processor().info
                out[modality] = _embedding_items(info, modality, value)
            except Exception as error:  # vLLM's parser refuses the merged dict (or ours an item)
                at = where[0] if where else _ROOT
                raise _refusal(messages, at, error) from error
            continue
        if modality != "audio" or not isinstance(value, list):
            continue
        items: list[object] = []
        for i, item in enumerate(value):
            if isinstance(item, tuple):  # raw audio; embeddings and cached-only items stay as given
                try:
                    info = info or renderer.get_mm_processor().info
                    parsed = info.parse_mm_data({modality: [item]}, validate=False)
                    (item,) = parsed[modality].get_all_items_for_hash()
                except Exception as error:  # vLLM's parser refuses in many ways (no resampler, ...)
                    at = where[i] if i < len(where) else _ROOT
                    raise _refusal(messages, at, error) from error
            items.append(item)
        out[modality] = items
    return out


def _embedding_items(info: Any, modality: str, merged: Mapping[str, Any]) -> list[EmbeddingFields]:
    """vLLM's items of a modality given as one dict of embedding fields, as records hold them.

    vLLM's own parser (the model's ``DictEmbeddingItems``) splits ``merged``; item ``i`` is
    its ``get(i)``, the dict vLLM keys, and each field's merge rule is read from the
    model's field config, so ``to_vllm`` hands back a dict that splits into the same items.
    """
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFlatField, MultiModalSharedField
    from vllm.multimodal.parse import DictEmbeddingItems

    parsed = info.parse_mm_data({modality: dict(merged)}, validate=False)[modality]
    if not isinstance(parsed, DictEmbeddingItems):
        raise InvalidPromptError(
            f"$.multi_modal_data.{modality}",
            f"vLLM's parser read the dict as {type_name(parsed)}, not as embedding fields",
        )
    items: list[EmbeddingFields] = []
    for i in range(parsed.get_count()):
        fields: Mapping[str, Any] = parsed.get(i)  # what vLLM hashes for item i (get_item_for_hash)
        layout: dict[str, str] = {}
        for name in fields:
            field = parsed.fields_config[name].field
            if isinstance(field, MultiModalBatchedField):
                layout[name] = "batched"
            elif isinstance(field, MultiModalFlatField):
                layout[name] = f"flat:{field.dim}"
            elif isinstance(field, MultiModalSharedField):
                layout[name] = "shared"
            else:
                raise InvalidPromptError(
                    f"$.multi_modal_data.{modality}.{name}",
                    f"vLLM's field config gives it {type_name(field)}, whose merge records do not know",
                )
        items.append(EmbeddingFields(fields, layout))
    return items


def chat_with_vllm(
    messages: Sequence[Mapping[str, Any]],
    renderer: Any,
    *,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tokenization_kwargs: Mapping[str, Any] | None = None,
    media_io_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
    **fields: Any,
) -> TokensPrompt:
    """The record vLLM's own chat path builds for ``messages`` (see :func:`chat_to_prompt`)."""
    from omni_requests_vllm import from_vllm

    if not callable(getattr(renderer, "render_messages", None)):
        inner = getattr(renderer, "renderer", None)
        if not callable(getattr(inner, "render_messages", None)) or not hasattr(renderer, "chat_template"):
            raise PromptTypeError(
                "$.renderer",
                f"must be a vLLM renderer (with render_messages) or an LLM, got {type_name(renderer)}",
            )
        # An LLM: LLM.chat renders with the template the LLM was built with where the
        # call names none; its renderer alone cannot know that template.
        if chat_template is None:
            chat_template = renderer.chat_template
        renderer = inner
    checked = _checked_messages(messages)
    params = _chat_params(
        renderer,
        chat_template=chat_template,
        chat_template_content_format=chat_template_content_format,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        media_io_kwargs=media_io_kwargs,
        mm_processor_kwargs=mm_processor_kwargs,
    )
    try:
        _, prompt = renderer.render_messages(_copied(checked), params)
        tok_params = renderer.default_chat_tok_params.with_kwargs(
            **{"add_special_tokens": False, **dict(tokenization_kwargs or {})}
        )
        (tokens,) = renderer.tokenize_prompts([prompt], tok_params)
    except Exception as error:  # vLLM refuses with many kinds; each is named below
        where = _locate(renderer, checked, params)
        raise _refusal(checked, where, error) from error
    if "prompt_token_ids" not in tokens or "_prompt_embeds" in tokens:
        raise InvalidPromptError(
            _ROOT, "vLLM rendered this chat to prompt embeddings, which records do not carry"
        )
    # What render_chat and LLM.chat add before the engine sees the prompt.
    record: dict[str, Any] = {**tokens, "media_io_kwargs": params.media_io_kwargs or {}}
    if tokens.get("multi_modal_data"):
        record["multi_modal_data"] = _as_parsed(renderer, tokens["multi_modal_data"], checked)
    if mm_processor_kwargs is not None:
        record["mm_processor_kwargs"] = dict(mm_processor_kwargs)
    record.update(fields)
    try:
        built = from_vllm(record)
    except OmniRequestsError as error:
        raise at_part(error, _part_paths(checked)) from None
    assert isinstance(built, TokensPrompt)
    return built
