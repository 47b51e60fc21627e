"""OpenAI-style chat messages to a prompt record, so chat media is scoped like any prompt.

vllm-omni's chat server renders media before it routes, so stage-0 scoping never sees
those keys. Building a record from the messages first, and then scoping that with
:func:`scope_stage0`, gives chat requests the same ``stage0:rep{R}:{base}`` keys as plain
prompts.

With a vLLM renderer (``renderer=``) the record is built by vLLM's own chat code
(:mod:`._vllm_chat`): same tokens, placeholders and keys as vLLM's chat path. Without
one, a small stand-in (no vLLM needed) builds a :class:`~omni_requests.TextPrompt` with a
template you pass; it places media like vLLM but is not proven equal to any model's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias, overload

import attrs
from pyrsistent import pvector

from omni_requests import InvalidPromptError, OmniRequestsError, PromptTypeError, TextPrompt, TokensPrompt
from omni_requests._adapter_api import type_name

from ._loaders import DefaultLoader, MediaLoader, MediaLoadError
from ._vllm_chat import at_part, chat_with_vllm, checked_roles, part_uuid

__all__ = ["DEFAULT_PLACEHOLDERS", "ChatTemplate", "chat_to_prompt", "default_chat_template"]

ChatTemplate: TypeAlias = Callable[[list[dict[str, str]]], str]
"""Renders ``[{"role": ..., "content": ...}]`` (media replaced by placeholders) to the prompt text."""

DEFAULT_PLACEHOLDERS: Final[Mapping[str, str]] = {"image": "<image>", "video": "<video>", "audio": "<audio>"}

# Content part type -> (modality, the key holding its URL).
_MEDIA_PARTS: Final = {
    "image_url": ("image", "image_url"),
    "video_url": ("video", "video_url"),
    "audio_url": ("audio", "audio_url"),
    "input_audio": ("audio", "input_audio"),
    "input_image": ("image", "image_url"),  # the Responses API's image part
}
# Parts vLLM reads as text (their content sits under the key of the same name, or "text").
_TEXT_PARTS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# The fields vLLM reads a part by where it has a 'uuid' or no 'type', first match wins.
_KEYED_PARTS: Final = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
# Message fields the stand-in's flat template cannot carry; vLLM's path gives them to the template.
_VLLM_ONLY_FIELDS: Final = ("tool_calls", "tool_call_id", "name")


def default_chat_template(conversation: list[dict[str, str]]) -> str:
    """A model-neutral stand-in: ``<|role|>`` and the content per turn, then ``<|assistant|>``.

    Engines pass their tokenizer's template instead, e.g.
    ``lambda c: tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)``.

    >>> default_chat_template([{"role": "user", "content": "<image>\\nhi"}])
    '<|user|>\\n<image>\\nhi\\n<|assistant|>\\n'
    """
    return "".join(f"<|{turn['role']}|>\n{turn['content']}\n" for turn in conversation) + "<|assistant|>\n"


def _url_of(part_type: str, value: object, path: str) -> str | None:
    """The URL a media part points at, or None when it gives only a UUID."""
    if value is None:
        return None
    if part_type == "input_audio":
        if not isinstance(value, Mapping):
            raise PromptTypeError(path, f"must be an object with 'data' and 'format', got {type_name(value)}")
        data, audio_format = value.get("data") or "", value.get("format") or ""
        if not isinstance(data, str) or not isinstance(audio_format, str):
            raise PromptTypeError(path, "'data' and 'format' must be str")
        if not data:
            return None
        return f"data:audio/{audio_format.lower()};base64,{data}"
    if isinstance(value, Mapping):
        value = value.get("url")
        if value is None:
            return None
    if not isinstance(value, str):
        raise PromptTypeError(path, f"must be a URL str or an object with 'url', got {type_name(value)}")
    return value or None


_DETAILS: Final = ("auto", "low", "high", "original")


def _check_typed_part(part_type: str, part: Mapping[str, Any], path: str) -> None:
    """What vLLM checks of a typed media part without a ``uuid``: it validates the part
    against OpenAI's own schema (an object with a str ``url``; for ``input_image`` a str
    ``image_url`` and a ``detail``), where a part with a ``uuid`` is read loosely."""
    if part_type == "input_image":
        detail = part.get("detail")
        if detail not in _DETAILS:
            raise InvalidPromptError(
                f"{path}.detail", f"must be one of {', '.join(_DETAILS)} (vLLM requires it), got {detail!r}"
            )
        image_url = part.get("image_url")
        if image_url is not None and not isinstance(image_url, str):
            raise PromptTypeError(f"{path}.image_url", f"must be a URL str, got {type_name(image_url)}")
        return
    if part_type == "input_audio":  # vLLM reads it as given
        return
    value = part.get(part_type)
    if not isinstance(value, Mapping):
        raise PromptTypeError(
            f"{path}.{part_type}",
            "must be an object with a 'url' (a bare URL str only with a 'uuid', as in vLLM), "
            f"got {type_name(value)}",
        )
    url = value.get("url")
    if not isinstance(url, str):
        raise PromptTypeError(f"{path}.{part_type}.url", f"must be a str, got {type_name(url)}")
    if part_type == "image_url" and "detail" in value and value["detail"] not in _DETAILS:
        raise InvalidPromptError(
            f"{path}.image_url.detail", f"must be one of {', '.join(_DETAILS)}, got {value['detail']!r}"
        )


def _part_type(part: Mapping[str, Any], path: str) -> tuple[str, str]:
    """The part's type as vLLM reads it, and the path to name when that type is unsupported."""
    part_type = part.get("type")
    if part_type is None or part.get("uuid") is not None:
        # vLLM reads such a part by the first media field it holds, whatever its 'type'
        # says, and refuses one that holds none (parse_chat_message_content_mm_part).
        field = next(
            (
                name
                for name in _KEYED_PARTS
                if name in part and not (name == "audio_embeds" and part_type == "video_embeds")
            ),
            None,
        )
        if field is not None:
            return field, f"{path}.{field}"
        if part_type is None:
            raise InvalidPromptError(
                path, "a content part needs a 'type' or a media field ('image_url', ...); vLLM refuses it"
            )
        raise InvalidPromptError(
            f"{path}.uuid",
            "vLLM reads a part with a 'uuid' by its media field ('image_url', 'audio_url', "
            "'input_audio', 'video_url') and refuses this one, which has none (a text part takes "
            "no 'uuid'; a cached-only item gives its media field as null)",
        )
    if not isinstance(part_type, str):
        raise PromptTypeError(f"{path}.type", f"must be a str, got {type_name(part_type)}")
    return part_type, f"{path}.type"


_UNSET: Any = object()
# What the chat itself renders from the messages: a keyword may not replace it.
_RENDERED_FIELDS: Final = ("prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids")
# What the stand-in passes on to its TextPrompt: the fields the chat does not render.
_RECORD_FIELDS: Final = frozenset(attrs.fields_dict(TextPrompt)) - set(_RENDERED_FIELDS)


@overload
def chat_to_prompt(
    messages: Sequence[Mapping[str, Any]],
    *,
    renderer: None = None,
    loader: MediaLoader | None = None,
    template: ChatTemplate = ...,
    placeholders: Mapping[str, str] = ...,
    **fields: Any,
) -> TextPrompt: ...
@overload
def chat_to_prompt(
    messages: Sequence[Mapping[str, Any]], *, renderer: Any, **options: Any
) -> TokensPrompt: ...
def chat_to_prompt(
    messages: Sequence[Mapping[str, Any]],
    *,
    renderer: Any = None,
    loader: MediaLoader | None = None,
    template: ChatTemplate = _UNSET,
    placeholders: Mapping[str, str] = _UNSET,
    **fields: Any,
) -> TextPrompt | TokensPrompt:
    """The prompt record for OpenAI-style chat ``messages``.

    **With vLLM** (``renderer=`` an ``LLM``, or a vLLM renderer, e.g. ``LLM(...).renderer``
    or ``renderer_from_config(vllm_config)``): the messages go through vLLM's own chat code
    exactly as ``LLM.chat`` sends them (its parser and media connector, the chat template,
    tokenization without added special tokens), and the result becomes a
    :class:`~omni_requests.TokensPrompt`. Every part vLLM accepts is accepted (``text``,
    ``input_text``, ``output_text``, ``refusal``, ``thinking``, ``image_url``,
    ``input_image``, ``image_pil``, ``image_embeds``, ``audio_url``, ``input_audio``,
    ``audio_embeds``, ``video_url``, ``video_embeds``, per-part ``uuid``), and ``name``,
    ``tool_calls`` and ``tool_call_id`` reach the template. ``to_vllm`` of the record fed to
    the same renderer gives vLLM's own prompt token ids, placeholders and ``mm_hashes``.
    Given the ``LLM`` itself, its own ``chat_template`` (``LLM(chat_template=...)``) is the
    default, as in ``LLM.chat``; a renderer alone renders with the tokenizer's template
    unless ``chat_template=`` is given (pass ``chat_template=llm.chat_template``).
    Keyword options are ``LLM.chat``'s: ``chat_template``, ``chat_template_content_format``,
    ``chat_template_kwargs``, ``add_generation_prompt`` (default True),
    ``continue_final_message``, ``tools``, ``tokenization_kwargs``, ``mm_processor_kwargs``,
    plus ``media_io_kwargs``; other keywords (``cache_salt``, ...) go to the record, never
    one the chat renders (``prompt``, ``prompt_token_ids``, ``multi_modal_data``,
    ``multi_modal_uuids``: refused). What
    vLLM refuses is refused with an error naming the message and part
    (``$.messages[2].content[1]``), vLLM's own message included. Audio parts become the
    waveform vLLM's parser makes of them (resampled to the model's rate), which is what
    vLLM keys. ``image_embeds``/``video_embeds`` given as dicts (with their grid, as
    Qwen2-VL needs), which vLLM merges into one dict per modality, become the items vLLM's
    parser splits that dict into (one ``EmbeddingFields`` each);
    ``to_vllm`` merges them back.

    **Without vLLM** (no ``renderer``), a small stand-in: ``image_url``, ``input_image``,
    ``video_url``, ``audio_url`` and ``input_audio`` parts are loaded with ``loader``
    (default: :class:`DefaultLoader`) into ``multi_modal_data``, in order; a part's
    ``uuid`` becomes its ``multi_modal_uuids`` entry, and a part with a ``uuid`` whose
    media field is null stands for an item the engine has cached. As in vLLM, a part with
    a ``uuid`` or without a ``type`` is read by its first media field, whatever its
    ``type``, and one with no media field is refused (a text part takes no ``uuid``); a
    typed part without a ``uuid`` is checked against OpenAI's schema as vLLM checks it
    (``image_url``, ``video_url``, ``audio_url``: objects with a str ``url``;
    ``input_image``: a ``detail`` and a str ``image_url``); a ``uuid`` is a non-empty str
    or an int (``str()``-ed, as vLLM does). Every part is checked before any media is
    loaded. As in vLLM, a message's placeholders (``placeholders``, one per item, grouped
    by modality; none where it is empty) come first, then its non-empty text parts
    joined with newlines; placeholders its text already holds are not added again, and
    more of them than items are refused;
    ``template`` renders the turns into a :class:`~omni_requests.TextPrompt`. The
    template is yours, so the prompt is not proven equal to any model's; messages with
    ``name``, ``tool_calls`` or ``tool_call_id`` are refused (the stand-in's flat turns
    cannot carry them). Errors name the part, e.g. ``$.messages[0].content[1].image_url``.

    >>> import base64, io, wave
    >>> buffer = io.BytesIO()
    >>> with wave.open(buffer, "wb") as w:
    ...     w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000); w.writeframes(bytes(64))
    >>> clip = base64.b64encode(buffer.getvalue()).decode()
    >>> p = chat_to_prompt([{"role": "user", "content": [
    ...     {"type": "text", "text": "transcribe"},
    ...     {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}, "uuid": "clip-7"}]}])
    >>> p.prompt
    '<|user|>\\n<audio>\\ntranscribe\\n<|assistant|>\\n'
    >>> (uuid,), ((samples, rate),) = p.multi_modal_uuids["audio"], p.multi_modal_data["audio"]
    >>> uuid, rate
    ('clip-7', 16000)
    """
    rendered = [name for name in _RENDERED_FIELDS if name in fields]
    if rendered:
        raise InvalidPromptError(
            f"$.{rendered[0]}",
            "is what the chat renders from the messages; give media and per-part uuids in the messages",
        )
    if renderer is not None:
        given = [
            name
            for name, value in (("loader", loader), ("template", template), ("placeholders", placeholders))
            if value is not None and value is not _UNSET
        ]
        if given:
            raise InvalidPromptError(
                f"$.{given[0]}",
                "is for the stand-in without vLLM; with renderer=, vLLM's chat template renders",
            )
        return chat_with_vllm(messages, renderer, **fields)
    if placeholders is not _UNSET:
        _check_placeholders(placeholders)
    _check_stand_in(loader, template, fields)
    return _stand_in(
        messages,
        loader=loader,
        template=default_chat_template if template is _UNSET else template,
        placeholders=DEFAULT_PLACEHOLDERS if placeholders is _UNSET else placeholders,
        fields=fields,
    )


def _check_stand_in(loader: object, template: object, fields: Mapping[str, Any]) -> None:
    """The stand-in's arguments, checked before any media is loaded."""
    if loader is not None and not callable(loader):  # None: the default loader
        raise PromptTypeError("$.loader", f"must be callable or None, got {type_name(loader)}")
    if template is not _UNSET and not callable(template):
        raise PromptTypeError("$.template", f"must be callable, got {type_name(template)}")
    unknown = [name for name in fields if name not in _RECORD_FIELDS]
    if unknown:
        raise PromptTypeError(
            f"$.{unknown[0]}",
            "is neither an option of chat_to_prompt nor a TextPrompt field "
            f"(fields: {', '.join(sorted(_RECORD_FIELDS))})",
        )


def _check_placeholders(placeholders: object) -> None:
    if not isinstance(placeholders, Mapping):
        raise PromptTypeError(
            "$.placeholders",
            f"must be a mapping of modality to placeholder text, got {type_name(placeholders)}",
        )
    for modality, mark in placeholders.items():
        if not isinstance(mark, str):
            raise PromptTypeError(f"$.placeholders.{modality}", f"must be a str, got {type_name(mark)}")


def _stand_in(
    messages: Sequence[Mapping[str, Any]],
    *,
    loader: MediaLoader | None,
    template: ChatTemplate,
    placeholders: Mapping[str, str],
    fields: Mapping[str, Any],
) -> TextPrompt:
    # Every part is read and checked before any media is loaded or any record is built.
    conversation, wanted = _read_messages(messages, placeholders)
    load = loader if loader is not None else DefaultLoader()
    data: dict[str, list[object]] = {}
    uuids: dict[str, list[str | None]] = {}
    parts: dict[str, list[str]] = {}  # per modality, the path of each item's part
    for item in wanted:
        loaded = None if item.url is None else _load(load, item.modality, item.url, item.url_path)
        data.setdefault(item.modality, []).append(loaded)
        uuids.setdefault(item.modality, []).append(item.uuid)
        parts.setdefault(item.modality, []).append(item.path)
    given = any(uuid is not None for row in uuids.values() for uuid in row)
    try:
        return TextPrompt(
            prompt=template(conversation),
            # pvectors are taken as lists of items, never re-split the way a bare value is.
            multi_modal_data={modality: pvector(items) for modality, items in data.items()},
            multi_modal_uuids={modality: pvector(row) for modality, row in uuids.items()} if given else None,
            **fields,
        )
    except OmniRequestsError as error:  # an item's or UUID's error, named at its part
        raise at_part(error, parts) from None


@attrs.frozen
class _Wanted:
    """One media item a message asks for: where it comes from, before it is loaded."""

    modality: str
    url: str | None  # None: only a uuid, an item the engine has cached
    uuid: str | None
    path: str  # the part
    url_path: str  # the part's media field, named when loading fails


def _read_messages(
    messages: Sequence[Mapping[str, Any]], placeholders: Mapping[str, str]
) -> tuple[list[dict[str, str]], list[_Wanted]]:
    """The turns the template renders and the media items, in order, as vLLM's parser reads them."""
    conversation: list[dict[str, str]] = []
    wanted: list[_Wanted] = []
    for where, message, role in checked_roles(messages):
        for name in _VLLM_ONLY_FIELDS:
            if message.get(name) is not None:
                raise InvalidPromptError(
                    f"{where}.{name}",
                    "the stand-in chat template cannot carry it; pass renderer= (vLLM) to render it",
                )
        content = message.get("content")
        if content is None or isinstance(content, str):
            conversation.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, Sequence):
            raise PromptTypeError(
                f"{where}.content", f"must be a str or a list of parts, got {type_name(content)}"
            )
        texts: list[str] = []
        marks: list[str] = []
        for p, part in enumerate(content):
            at = f"{where}.content[{p}]"
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise PromptTypeError(at, f"must be a content part object, got {type_name(part)}")
            part_type, type_path = _part_type(part, at)
            if part_type in _TEXT_PARTS:
                key = _TEXT_PARTS[part_type]
                text = part.get(key)
                if text is None:  # vLLM skips a text part without text
                    continue
                if not isinstance(text, str):
                    raise PromptTypeError(f"{at}.{key}", f"must be a str, got {type_name(text)}")
                texts.append(text)
                continue
            if part_type not in _MEDIA_PARTS:
                raise InvalidPromptError(
                    type_path,
                    f"unsupported content part {part_type!r} without vLLM; supported: "
                    f"{', '.join([*_TEXT_PARTS, *_MEDIA_PARTS])} "
                    "(pass renderer= for every part vLLM accepts)",
                )
            modality, key = _MEDIA_PARTS[part_type]
            uuid = part_uuid(part, at)
            if uuid is None and part.get("type") == part_type:
                _check_typed_part(part_type, part, at)
            url = _url_of(part_type, part.get(key), f"{at}.{key}")
            if url is None and uuid is None:
                raise InvalidPromptError(f"{at}.{key}", "gives no media and no uuid")
            wanted.append(_Wanted(modality, url, uuid, at, f"{at}.{key}"))
            mark = placeholders.get(modality, f"<{modality}>")
            if mark:  # vLLM adds none where the model has no placeholder text (None or "")
                marks.append(mark)
        # vLLM's default (interleave_mm_strings off): empty text parts dropped, then the
        # placeholders the text does not already hold first, then the text.
        text = "\n".join(t for t in texts if t)
        missing = _missing_placeholders(marks, text, f"{where}.content")
        conversation.append({"role": role, "content": "\n".join([*missing, text] if text else missing)})
    return conversation, wanted


def _missing_placeholders(marks: list[str], text: str, path: str) -> list[str]:
    """The message's placeholders its text does not hold already, as vLLM counts them."""
    missing: list[str] = []
    for mark, count in Counter(marks).items():
        left = count - text.count(mark)
        if left < 0:
            raise InvalidPromptError(
                path,
                f"its text holds more {mark!r} placeholders than the message has items ({count}); "
                "vLLM refuses it",
            )
        missing.extend([mark] * left)
    return missing


def _load(load: MediaLoader, modality: str, url: str, path: str) -> object:
    try:
        return load(modality, url)
    except OmniRequestsError as error:
        raise error.under(path) from None
    except (ValueError, OSError) as error:
        raise MediaLoadError(path, f"{type(error).__name__}: {error}") from None
