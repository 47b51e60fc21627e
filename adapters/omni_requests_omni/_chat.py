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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias, overload

from pyrsistent import pvector

from omni_requests import InvalidPromptError, OmniRequestsError, PromptTypeError, TextPrompt, TokensPrompt
from omni_requests._adapter_api import type_name

from ._loaders import DefaultLoader, MediaLoader, MediaLoadError
from ._vllm_chat import chat_with_vllm

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
# Message fields the stand-in's flat template cannot carry; vLLM's path gives them to the template.
_VLLM_ONLY_FIELDS: Final = ("tool_calls", "tool_call_id", "name")
_ROOT: Final = "$.messages"


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


def _part_type(part: Mapping[str, Any], path: str) -> str:
    part_type = part.get("type")
    if part_type is None:  # vLLM accepts a part without 'type' that holds one media key
        found = [name for name in ("text", *_MEDIA_PARTS) if name in part and name != "input_image"]
        if len(found) != 1:
            raise InvalidPromptError(path, "a content part needs a 'type'")
        part_type = found[0]
    if not isinstance(part_type, str):
        raise PromptTypeError(f"{path}.type", f"must be a str, got {type_name(part_type)}")
    if part_type not in _TEXT_PARTS and part_type not in _MEDIA_PARTS:
        raise InvalidPromptError(
            f"{path}.type",
            f"unsupported content part {part_type!r} without vLLM; supported: "
            f"{', '.join([*_TEXT_PARTS, *_MEDIA_PARTS])} (pass renderer= for every part vLLM accepts)",
        )
    return part_type


def chat_to_prompt(
    messages: Sequence[Mapping[str, Any]],
    *,
    loader: MediaLoader | None = None,
    template: ChatTemplate = default_chat_template,
    placeholders: Mapping[str, str] = DEFAULT_PLACEHOLDERS,
    **fields: Any,
) -> TextPrompt:
    """The prompt record for OpenAI-style chat ``messages``.

    Content parts ``image_url``, ``video_url``, ``audio_url`` and ``input_audio`` are
    loaded with ``loader`` (default: :class:`DefaultLoader`, data URLs only) into
    ``multi_modal_data``, in order; a part's ``uuid`` becomes its
    ``multi_modal_uuids`` entry, and a part with a ``uuid`` and no media stands for an
    item the engine has cached. Each media part is replaced by its modality's
    placeholder, parts are joined with newlines, and ``template`` renders the turns.
    Other keyword arguments (``mm_processor_kwargs``, ``cache_salt``, ...) go to the
    record. Errors name the part, e.g. ``$[0].content[1].image_url``.

    >>> import base64, io, wave
    >>> buffer = io.BytesIO()
    >>> with wave.open(buffer, "wb") as w:
    ...     w.setnchannels(1); w.setsampwidth(2); w.setframerate(16000); w.writeframes(bytes(64))
    >>> clip = base64.b64encode(buffer.getvalue()).decode()
    >>> p = chat_to_prompt([{"role": "user", "content": [
    ...     {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}, "uuid": "clip-7"},
    ...     {"type": "text", "text": "transcribe"}]}])
    >>> p.prompt
    '<|user|>\\n<audio>\\ntranscribe\\n<|assistant|>\\n'
    >>> (uuid,), ((samples, rate),) = p.multi_modal_uuids["audio"], p.multi_modal_data["audio"]
    >>> uuid, rate
    ('clip-7', 16000.0)
    """
    load = loader if loader is not None else DefaultLoader()
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise PromptTypeError("$", f"messages must be a list of message objects, got {type_name(messages)}")
    conversation: list[dict[str, str]] = []
    data: dict[str, list[object]] = {}
    uuids: dict[str, list[str | None]] = {}
    for m, message in enumerate(messages):
        where = f"$[{m}]"
        if not isinstance(message, Mapping):
            raise PromptTypeError(where, f"must be a message object, got {type_name(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidPromptError(f"{where}.role", f"must be a non-empty str, got {role!r}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            conversation.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, Sequence):
            raise PromptTypeError(
                f"{where}.content", f"must be a str or a list of parts, got {type_name(content)}"
            )
        pieces: list[str] = []
        for p, part in enumerate(content):
            at = f"{where}.content[{p}]"
            if not isinstance(part, Mapping):
                raise PromptTypeError(at, f"must be a content part object, got {type_name(part)}")
            part_type = _part_type(part, at)
            if part_type == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise PromptTypeError(f"{at}.text", f"must be a str, got {type_name(text)}")
                pieces.append(text)
                continue
            modality, key = _MEDIA_PARTS[part_type]
            uuid = part.get("uuid")
            if uuid is not None and (not isinstance(uuid, str) or not uuid):
                raise InvalidPromptError(f"{at}.uuid", f"must be a non-empty str, got {uuid!r}")
            url = _url_of(part_type, part.get(key), f"{at}.{key}")
            if url is None and uuid is None:
                raise InvalidPromptError(f"{at}.{key}", "gives no media and no uuid")
            item = None if url is None else _load(load, modality, url, f"{at}.{key}")
            data.setdefault(modality, []).append(item)
            uuids.setdefault(modality, []).append(uuid)
            pieces.append(placeholders.get(modality, f"<{modality}>"))
        conversation.append({"role": role, "content": "\n".join(pieces)})
    given = any(uuid is not None for row in uuids.values() for uuid in row)
    return TextPrompt(
        prompt=template(conversation),
        # pvectors are taken as lists of items, never re-split the way a bare value is.
        multi_modal_data={modality: pvector(items) for modality, items in data.items()},
        multi_modal_uuids={modality: pvector(row) for modality, row in uuids.items()} if given else None,
        **fields,
    )


def _load(load: MediaLoader, modality: str, url: str, path: str) -> object:
    try:
        return load(modality, url)
    except OmniRequestsError as error:
        raise type(error)(path + error.path[1:], error.message) from None
    except (ValueError, OSError) as error:
        raise MediaLoadError(path, f"{type(error).__name__}: {error}") from None
