"""Records to vLLM prompt dicts and back."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar, overload

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
from omni_requests._adapter_api import (
    SINGLE_KINDS,
    as_made,
    check_one_scope,
    derived,
    fits_embeds_prompt,
    is_embedding_modality,
    is_own_array,
    is_pil_image,
    is_torch_tensor,
    media_rows,
    merge_embedding_fields,
    seal_of,
    thaw,
    type_name,
    unreadable,
)

if TYPE_CHECKING:
    # vLLM's own prompt types, for type checkers only: `llm.generate(to_vllm(record))`
    # then checks against vLLM's signatures. At run time to_vllm returns plain dicts.
    from vllm.inputs import EmbedsPrompt as _VllmEmbedsPrompt
    from vllm.inputs import ExplicitEncoderDecoderPrompt as _VllmEncoderDecoderPrompt
    from vllm.inputs import TextPrompt as _VllmTextPrompt
    from vllm.inputs import TokensPrompt as _VllmTokensPrompt

__all__ = ["VllmPrompt", "from_vllm", "to_vllm"]

VllmPrompt: TypeAlias = dict[str, Any]
"""A vLLM prompt dict (``TextPrompt``, ``TokensPrompt``, ``EmbedsPrompt`` or
``ExplicitEncoderDecoderPrompt``; vllm-omni's ``Omni*Prompt`` where omni fields are set)."""

# Record fields that are not vLLM keys: the scope is rendered into the UUIDs.
_NOT_DICT_KEYS: Final = frozenset({"scope"})


def _dict_keys(kind: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(kind) if f.name not in _NOT_DICT_KEYS)


_KEYS: Final = {kind: _dict_keys(kind) for kind in SINGLE_KINDS}
# Fields go out main field first, like the dicts people write.
_MAIN: Final = {TextPrompt: "prompt", TokensPrompt: "prompt_token_ids", EmbedsPrompt: "prompt_embeds"}
_MEDIA: Final = ("multi_modal_data", "multi_modal_uuids")
# The other fields, in field order; they go out only when set. A plan per kind: the main
# field, the option names, one call that reads them all, and what it reads when none is set.
_Plan: TypeAlias = "tuple[str, tuple[str, ...], Callable[[Any], tuple[Any, ...]], tuple[None, ...]]"


def _plan(kind: type[Any]) -> _Plan:
    options = tuple(k for k in _KEYS[kind] if k != _MAIN[kind] and k not in _MEDIA)
    return (_MAIN[kind], options, operator.attrgetter(*options), (None,) * len(options))


_PLANS: Final[dict[type[Any], _Plan]] = {kind: _plan(kind) for kind in SINGLE_KINDS}
# Values thaw() returns as they are: skip the call (to_vllm is on every request's path).
# Not arrays: a record hands out a fresh view of each, as made (see thaw).
_AS_IS: Final = frozenset({str, bytes, int, float, bool, type(None)})


@overload
def to_vllm(prompt: TextPrompt) -> _VllmTextPrompt: ...
@overload
def to_vllm(prompt: TokensPrompt) -> _VllmTokensPrompt: ...
@overload
def to_vllm(prompt: EmbedsPrompt) -> _VllmEmbedsPrompt: ...
@overload
def to_vllm(prompt: EncoderDecoderPrompt) -> _VllmEncoderDecoderPrompt: ...
def to_vllm(prompt: Prompt) -> Any:
    """The vLLM prompt dict for ``prompt``, with its media keys rendered.

    To a type checker the result is vLLM's own prompt type for the record's kind
    (``vllm.inputs.TextPrompt`` for a :class:`~omni_requests.TextPrompt`, and so on), so
    ``llm.generate(to_vllm(record))`` type-checks; at run time it is a plain dict.

    Only fields that are set appear. Lists, dicts and tuples are fresh plain objects
    each call, so the engine may change them without reaching the record; arrays are
    fresh read-only views of the record's arrays as made (no copy: a shape or dtype set
    on one reaches neither the record nor another request), and images and tensors
    fresh hand-outs of what the record sealed (copy-on-write views of its bytes; see
    ``docs/design.md``).
    """
    plan = _PLANS.get(type(prompt))
    if plan is not None:
        return _single_to_vllm(prompt, plan)  # type: ignore[arg-type]
    if isinstance(prompt, EncoderDecoderPrompt):
        check_one_scope(prompt)
        decoder = prompt.decoder_prompt
        return {
            "encoder_prompt": to_vllm(prompt.encoder_prompt),
            "decoder_prompt": None if decoder is None else to_vllm(decoder),
        }
    for kind in SINGLE_KINDS:  # a subclass of a record kind converts as its kind
        if isinstance(prompt, kind):
            return _single_to_vllm(prompt, _PLANS[kind])
    raise PromptTypeError("prompt", f"must be a prompt record, got {type_name(prompt)}")


def _single_to_vllm(prompt: SinglePrompt, plan: _Plan) -> VllmPrompt:
    # Everything but the keys depends only on fields a template shares with its scoped
    # copies, so it is laid out once per template (see omni_requests._records._Derived);
    # the dict, lists and maps handed out are still new each call.
    layout: Any = derived(prompt, _LAYOUT, _layout, plan)
    if layout is _THAW_EACH_TIME:
        return _thawed(prompt, plan)
    main, data, options = layout
    out: VllmPrompt = {plan[0]: main}
    if data:
        # A record's arrays, sealed images and tensors go out as fresh hand-outs (see thaw);
        # arrays alone, the common case, as fresh views of their twins, without a call. A
        # loop, not a comprehension: no frame of its own (3.11), on every request's path.
        media = out["multi_modal_data"] = {}
        for m, items, out_as in data:
            media[m] = list(map(_VIEW, out_as)) if type(out_as) is tuple else _handed_out(items, out_as)
    uuids = rendered_uuids(prompt)
    if uuids is not None:
        out["multi_modal_uuids"] = uuids
    if options:
        out.update(options)
    return out


_LAYOUT: Final = "omni_requests_vllm.layout"
_THAW_EACH_TIME: Final = ("thaw each time",)
# How a modality's items go out: a new list of them as they are, each thawed, or (a tuple)
# a fresh view of each of these twins (the record's arrays as made; see as_made).
_AS_GIVEN: Final = "as given"
_THAW: Final = "thaw"
_VIEW: Final = np.ndarray.view
_Layout: TypeAlias = "tuple[Any, tuple[tuple[str, tuple[Any, ...], Any], ...], tuple[tuple[str, Any], ...]]"


def _layout(prompt: SinglePrompt, plan: _Plan) -> _Layout | tuple[str]:
    """The values that go out as they are, or a marker: some value is a container, thawed each call."""
    name, options, read_options, _ = plan
    main = getattr(prompt, name)
    data = tuple((m, items, _out_as(items)) for m, items, _ in media_rows(prompt) if items is not None)
    given = tuple((n, v) for n, v in zip(options, read_options(prompt), strict=True) if v is not None)
    fields = [main, *(v for _, v in given)]
    items = [item for _, items, _ in data for item in items]
    # thaw() hands tensors and images on as they are too; anything else is a container
    # (or an array out of a media map, which goes out as a fresh view each call).
    if not all(type(v) in _AS_IS or is_torch_tensor(v) or is_pil_image(v) for v in fields) or not all(
        type(v) in _AS_IS or type(v) is np.ndarray or is_torch_tensor(v) or is_pil_image(v) for v in items
    ):
        return _THAW_EACH_TIME
    return main, data, given


def _handed_out(items: tuple[Any, ...], out_as: str) -> list[Any]:
    return list(items) if out_as is _AS_GIVEN else [thaw(item) for item in items]


def _out_as(items: tuple[Any, ...]) -> Any:
    if items and all(type(item) is np.ndarray and is_own_array(item) for item in items):
        return tuple(as_made(item) for item in items)
    if any(type(item) is np.ndarray or seal_of(item) is not None for item in items):
        return _THAW
    return _AS_GIVEN


def _thawed(prompt: SinglePrompt, plan: _Plan) -> VllmPrompt:
    main, options, read_options, unset = plan
    value = getattr(prompt, main)
    out: VllmPrompt = {main: value if type(value) in _AS_IS else thaw(value)}
    data = [(m, items) for m, items, _ in media_rows(prompt) if items is not None]
    if data:
        out["multi_modal_data"] = {
            # A modality of EmbeddingFields goes out as the one dict vLLM takes for it.
            m: merge_embedding_fields(items)
            if is_embedding_modality(items)
            else [item if type(item) in _AS_IS else thaw(item) for item in items]
            for m, items in data
        }
    uuids = rendered_uuids(prompt)
    if uuids is not None:
        out["multi_modal_uuids"] = uuids
    values = read_options(prompt)
    if values != unset:  # most prompts set none of them: one comparison instead of a loop
        for name, value in zip(options, values, strict=True):
            if value is not None:
                out[name] = value if type(value) in _AS_IS else thaw(value)
    return out


# To a type checker the record's kind follows the input's type, as the rule below reads
# vLLM's own TypedDicts. (A TypedDict of more keys, such as one of another prompt's, gets
# the kind the rule picks at run time; annotate such input as Mapping[str, object].)
# Anything else gives the union. The last overload is generic on purpose: mypy infers
# Any for an argument holding Any (vLLM's TypedDicts do) that two overloads of different
# formal types match; a type variable's formal is the argument's own type, so it is not.
_Input = TypeVar("_Input")


@overload
def from_vllm(prompt: str) -> TextPrompt: ...
@overload
def from_vllm(prompt: list[int]) -> TokensPrompt: ...
@overload
def from_vllm(prompt: _VllmTextPrompt) -> TextPrompt: ...
@overload
def from_vllm(prompt: _VllmTokensPrompt) -> TokensPrompt: ...
@overload
def from_vllm(prompt: _VllmEmbedsPrompt) -> EmbedsPrompt: ...
@overload
def from_vllm(prompt: _VllmEncoderDecoderPrompt) -> EncoderDecoderPrompt: ...
@overload
def from_vllm(prompt: _Input) -> Prompt: ...
def from_vllm(prompt: object) -> Prompt:
    """The record for a vLLM prompt (a str, a list of token ids, or a prompt dict).

    The kind follows vLLM's own rule (embeddings, then tokens, then text), falling back
    to a kind that has every given key for vllm-omni's dicts. Every value is checked
    before a record is built; the error names the field, e.g.
    ``$.multi_modal_uuids.image[1]``. The input is never changed.
    """
    if isinstance(prompt, Mapping):
        holder = type(prompt)
        prompt = _with_plain_keys(prompt)
        try:
            pair, rendered = "encoder_prompt" in prompt, "type" in prompt
        except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
            raise unreadable("$", error) from None
        if rendered:  # what vLLM's process_inputs takes as its renderer's output
            why = "marks an input vLLM has already rendered (its media keyed by its mm_hashes), "
            why += "which no record holds: build the record from the prompt it was rendered from"
            if holder is not dict:
                why += "; scope_stage0 passes one on as it is only in a plain dict, "
                why += f"not a {holder.__qualname__}"
            raise InvalidPromptError("$.type", why)
        if pair:
            return _pair_from_vllm(prompt)
    return _single_from_vllm(prompt)


def _pair_from_vllm(prompt: Mapping[str, object]) -> EncoderDecoderPrompt:
    # Each read of the caller's mapping is named where its own code raises.
    try:
        unknown = sorted(set(prompt) - {"encoder_prompt", "decoder_prompt"})
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$", error) from None
    if unknown:
        raise InvalidPromptError(f"$.{unknown[0]}", "unknown field for an encoder-decoder prompt")
    try:
        encoder_value = prompt["encoder_prompt"]
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$.encoder_prompt", error) from None
    try:
        decoder_value = prompt.get("decoder_prompt")
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$.decoder_prompt", error) from None
    encoder = _nested(encoder_value, "$.encoder_prompt")
    decoder = None if decoder_value is None else _nested(decoder_value, "$.decoder_prompt")
    return EncoderDecoderPrompt(encoder_prompt=encoder, decoder_prompt=decoder)


def _with_plain_keys(prompt: Mapping[Any, object]) -> Mapping[str, object]:
    """``prompt``, or a copy of it keyed by plain ``str`` when a key is a subclass (read as
    its text: a subclass's own ``==`` could match any field); a key that is no str, or
    that gives a field twice, is refused by name."""
    plain = True
    if type(prompt) is dict:
        keys: Any = prompt  # a dict's iteration runs no code of the caller's
    else:
        try:
            keys = list(iter(prompt))  # iter(): list() alone would call its __len__ too
        except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
            raise unreadable("$", error) from None
    for key in keys:
        if type(key) is not str:
            if not isinstance(key, str):
                raise PromptTypeError("$", f"prompt keys must be str, got {type_name(key)}")
            plain = False
    if plain:
        return prompt
    try:
        rows = list(iter(prompt.items()))
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$", error) from None
    copied: dict[str, object] = {}
    for key, value in rows:
        text = str.__str__(key)
        if text in copied:
            raise InvalidPromptError(f"$.{text}", "is given twice (a str subclass key reads as its text)")
        copied[text] = value
    return copied


def _nested(value: object, path: str) -> SinglePrompt:
    try:
        return _single_from_vllm(_with_plain_keys(value) if isinstance(value, Mapping) else value)
    except OmniRequestsError as error:
        raise error.under(path) from None


def _single_from_vllm(prompt: object) -> SinglePrompt:
    if isinstance(prompt, str):
        return TextPrompt(prompt=prompt)
    if isinstance(prompt, list):
        return TokensPrompt(prompt_token_ids=prompt)
    if not isinstance(prompt, Mapping):
        raise PromptTypeError(
            "$", f"a prompt must be a str, a list of token ids or a dict, got {type_name(prompt)}"
        )
    if type(prompt) is not dict:
        prompt = _as_listed(prompt)
    kind = _kind_of(prompt)  # its keys plain str already (_with_plain_keys, by the caller)
    unknown = [key for key in prompt if key not in _KEYS[kind]]
    if unknown:
        raise InvalidPromptError(
            f"$.{unknown[0]}", f"unknown field for a {kind.__name__}; known fields: {', '.join(_KEYS[kind])}"
        )
    if "encoder_prompt" in prompt:
        raise InvalidPromptError("$.encoder_prompt", "encoder-decoder prompts cannot be nested")
    fields: dict[str, Any] = _as_vllm_reads(prompt)
    return kind(**fields)


# Every field any record kind has: vLLM reads each by name.
_FIELDS: Final = tuple(dict.fromkeys(name for names in _KEYS.values() for name in names))


def _as_listed(prompt: Mapping[str, object]) -> dict[str, object]:
    """A mapping that is no plain dict, as the dict of the keys it lists, each read by
    ``[]``; refused where it holds a field its iteration does not list.

    vLLM reads a prompt's fields by name; a record built from what the mapping lists
    would drop such a field silently (its media, say, while ``carries_media`` saw them).
    """
    try:
        keys = list(iter(prompt))
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$", error) from None
    listed: dict[str, object] = {}
    for key in keys:
        try:
            listed[key] = prompt[key]
        except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
            raise unreadable(f"$.{key}" if type(key) is str else "$", error) from None
    for name in _FIELDS:
        if name in listed:
            continue
        try:
            hidden = name in prompt
        except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
            raise unreadable("$", error) from None
        if hidden:
            raise InvalidPromptError(
                f"$.{name}",
                f"is in the prompt ({type_name(prompt)}) but not among the keys it lists, so "
                "what vLLM reads by name and what the record would be built from differ; give a plain dict",
            )
    return listed


def _as_vllm_reads(prompt: Mapping[str, object]) -> dict[str, object]:
    """The fields as vLLM's renderer reads them.

    A modality whose data is None and has UUIDs is dropped with them: vLLM ignores both
    (no item, so no key); without UUIDs vLLM refuses it, and so do records.
    """
    fields = dict(prompt)
    data = fields.get("multi_modal_data")
    if not isinstance(data, Mapping):
        return fields
    uuids = fields.get("multi_modal_uuids")
    if not isinstance(uuids, Mapping):
        return fields
    # Each map is read once, as its rows (a record is built from them below): a caller's
    # mapping whose own code raises is named.
    try:
        rows: Any = data.items() if type(data) is dict else list(iter(data.items()))
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$.multi_modal_data", error) from None
    if not any(value is None for _, value in rows):
        return fields  # the common case: the maps go on to the record as given
    try:
        uuid_rows = list(iter(uuids.items()))
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$.multi_modal_uuids", error) from None
    given = {m for m, u in uuid_rows if u is not None}
    dropped = {modality for modality, value in rows if value is None and modality in given}
    if dropped:
        fields["multi_modal_data"] = {m: v for m, v in rows if m not in dropped}
        fields["multi_modal_uuids"] = {m: u for m, u in uuid_rows if m not in dropped}
    return fields


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
            if (
                kind is EmbedsPrompt
                and len(candidates) > 1
                and not fits_embeds_prompt(prompt["prompt_embeds"])
            ):
                # vllm-omni's text or tokens prompt carrying embeddings for a diffusion
                # stage ((2, seq, hidden) for two images): vLLM's renderer would refuse it
                # as an embeds prompt, so it reads back as the prompt it came from.
                continue
            return kind
    return candidates[0]
