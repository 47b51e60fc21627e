"""pydantic support: a record can be a field of a pydantic model (a FastAPI request body).

pydantic looks for ``__get_pydantic_core_schema__`` and ``__get_pydantic_json_schema__``
on a field's class; :func:`install` puts them on the record classes when this module is
imported (``omni_requests/__init__.py`` imports it). Nothing here imports
pydantic until pydantic itself asks for a schema, so the core stays free of it.

Validation runs the record's own constructor, so a model field checks exactly what
``TextPrompt(**fields)`` checks, and its errors (with the field path) become pydantic
validation errors. From Python a field takes a record or a dict of its fields. From JSON
it takes the JSON-representable fields only: text, token ids, UUIDs, options, the salt;
media, embeddings and the scope cannot be JSON, and a client must not choose the scope.
Serialized to JSON, a record gives those fields (and refuses to drop media or a scope
silently); in Python mode it stays the record.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from ._errors import InvalidPromptError, OmniRequestsError, PromptTypeError, type_name
from ._media import plain_map, thaw
from ._records import SINGLE_KINDS, EmbedsPrompt, EncoderDecoderPrompt, TextPrompt, TokensPrompt

__all__ = ["install"]

_STRING: Final = {"type": "string"}
_NULLABLE_STRING: Final = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_IDS: Final = {"type": "array", "items": {"type": "integer"}}
_OBJECT: Final = {"type": "object"}
_UUIDS: Final = {
    "type": "object",
    "additionalProperties": {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        ]
    },
    "description": "The caller's UUID for each item, per modality; null where the content decides the key.",
}
# The JSON-representable fields and their schemas; every other field is media, an
# embedding tensor or the scope.
_JSON_FIELDS: Final[dict[str, dict[str, Any]]] = {
    "prompt": _STRING,
    "prompt_token_ids": _IDS,
    "token_type_ids": _IDS,
    "prompt_token_offsets": {"type": "array"},
    "prompt_is_token_ids": {"type": "array", "items": {"type": "boolean"}},
    "negative_prompt": _NULLABLE_STRING,
    "modalities": {"type": "array", "items": {"type": "string"}},
    "multi_modal_uuids": _UUIDS,
    "mm_processor_kwargs": _OBJECT,
    "media_io_kwargs": _OBJECT,
    "cache_salt": _NULLABLE_STRING,
    "additional_information": _OBJECT,
    "model_intermediate_buffer": _OBJECT,
}


def install() -> None:
    """Give the record classes pydantic's hooks (idempotent; imports no pydantic)."""
    for cls in (*SINGLE_KINDS, EncoderDecoderPrompt):
        setattr(cls, "__get_pydantic_core_schema__", classmethod(_core_schema))  # noqa: B010
        setattr(cls, "__get_pydantic_json_schema__", classmethod(_json_schema))  # noqa: B010


def _core_schema(cls: type[Any], source: Any, handler: Any) -> Any:
    from pydantic_core import core_schema

    def from_python(value: object) -> Any:
        return _validated(cls, value, json=False)

    def from_json(value: object) -> Any:
        return _validated(cls, value, json=True)

    return core_schema.json_or_python_schema(
        json_schema=core_schema.no_info_plain_validator_function(from_json),
        python_schema=core_schema.no_info_plain_validator_function(from_python),
        serialization=core_schema.plain_serializer_function_ser_schema(_to_json, when_used="json"),
    )


def _json_schema(cls: type[Any], core_schema: Any, handler: Any) -> dict[str, Any]:
    if cls is EncoderDecoderPrompt:
        single = {"anyOf": [_single_schema(TextPrompt), _single_schema(TokensPrompt)]}
        return {
            "title": cls.__name__,
            "type": "object",
            "properties": {"encoder_prompt": single, "decoder_prompt": {"anyOf": [single, {"type": "null"}]}},
            "required": ["encoder_prompt"],
            "additionalProperties": False,
        }
    return _single_schema(cls)


def _single_schema(cls: type[Any]) -> dict[str, Any]:
    names = [f.name for f in attrs.fields(cls) if f.name in _JSON_FIELDS]
    required = [f.name for f in attrs.fields(cls) if f.name in _JSON_FIELDS and f.default is attrs.NOTHING]
    schema: dict[str, Any] = {
        "title": cls.__name__,
        "type": "object",
        "properties": {name: dict(_JSON_FIELDS[name]) for name in names},
        "additionalProperties": False,
        "description": (cls.__doc__ or "").strip().splitlines()[0]
        + " Media, embeddings and the scope are not part of the JSON form.",
    }
    if required:
        schema["required"] = required
    return schema


def _validated(cls: type[Any], value: object, *, json: bool) -> Any:
    from pydantic_core import PydanticCustomError

    try:
        return _build(cls, value, "$", json=json)
    except OmniRequestsError as error:
        raise PydanticCustomError(
            "omni_requests", "{path}: {message}", {"path": error.path, "message": error.message}
        ) from None


def _build(cls: type[Any], value: object, path: str, *, json: bool) -> Any:
    if not json and isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise PromptTypeError(
            path, f"must be a {cls.__name__} or a mapping of its fields, got {type_name(value)}"
        )
    names = {f.name for f in attrs.fields(cls)}
    fields: dict[str, Any] = {}
    for name, field in value.items():
        where = f"{path}.{name}"
        if not isinstance(name, str) or name not in names:
            raise InvalidPromptError(where, f"is not a field of {cls.__name__}")
        if cls is EncoderDecoderPrompt:
            field = None if field is None else _build(_kind_of(field), field, where, json=json)
        elif json and name not in _JSON_FIELDS:
            raise InvalidPromptError(
                where,
                "cannot come from JSON (media, embeddings and the scope are set in Python, "
                "or sent with omni_requests.wire)",
            )
        fields[name] = field
    try:
        return cls(**fields)
    except OmniRequestsError as error:
        if path == "$":
            raise
        raise error.under(path) from None
    except TypeError as error:  # attrs: a required field is missing
        raise InvalidPromptError(path, f"{cls.__name__}: {error}") from None


def _kind_of(value: object) -> type[Any]:
    """The single-prompt kind a nested dict is, by vLLM's own rule (embeddings, tokens, text)."""
    if isinstance(value, SINGLE_KINDS):
        return type(value)
    if isinstance(value, Mapping):
        if "prompt_embeds" in value:
            return EmbedsPrompt
        if "prompt_token_ids" in value:
            return TokensPrompt
    return TextPrompt


def _to_json(record: Any) -> dict[str, Any]:
    if isinstance(record, EncoderDecoderPrompt):
        parts: dict[str, Any] = {}
        for name in ("encoder_prompt", "decoder_prompt"):
            part = getattr(record, name)
            try:
                parts[name] = None if part is None else _to_json(part)
            except OmniRequestsError as error:
                raise error.under(f"$.{name}") from None
        return parts
    out: dict[str, Any] = {}
    for field in attrs.fields(type(record)):
        value = getattr(record, field.name)
        if value is None or (field.name in ("multi_modal_data", "multi_modal_uuids") and not value):
            continue
        if field.name not in _JSON_FIELDS:
            raise PromptTypeError(
                f"$.{field.name}",
                "has no JSON form; send records with media or a scope with omni_requests.wire",
            )
        out[field.name] = _json_value(thaw(value), f"$.{field.name}")
    if "multi_modal_uuids" in out:  # in the caller's order
        out["multi_modal_uuids"] = {m: list(u) for m, u in plain_map(record.multi_modal_uuids).items()}
    return out


def _json_value(value: object, path: str) -> object:
    """``value`` when JSON gives it back as it is (a tuple as a list: JSON has one array
    type, and vLLM's hasher reads the two alike), else refused by name: serialized, bytes
    would come back as text, NaN as null, a set as a list, and a numpy value not at all."""
    if value is None or type(value) in (str, bool, int):
        return value
    if isinstance(value, float) and type(value) is float:
        if not math.isfinite(value):
            raise PromptTypeError(path, f"{value!r} has no JSON form (JSON writes it as null)")
        return value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return [_json_value(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise PromptTypeError(path, f"has a key {key!r} ({type_name(key)}); JSON keys are str")
            _json_value(item, f"{path}.{key}")
        return value
    raise PromptTypeError(
        path,
        f"a {type_name(value)} has no faithful JSON form (bytes would come back as text, a set "
        "as a list, numpy values not at all); send such a record with omni_requests.wire",
    )


install()
