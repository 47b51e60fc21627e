"""Property checks for any function that scopes prompts to replicas.

Point :func:`check_scoping` at a scoping function, ours or an engine's, and Hypothesis
drives it through the situations that broke vllm-omni: a prompt used as a template,
copied with new media, retried on another replica, rebuilt from equal media. Each
property in :data:`PROPERTIES` is searched separately; a failure raises
:class:`ScopingPropertyError` naming the property, with the shrunk counter-example.

Two kinds of function are accepted, told apart by ``to_dict``:

- records: ``fn(record, replica_id) -> record``, like
  ``functools.partial(scope_to_replica, hasher=...)``;
- dicts: ``fn(prompt_dict, replica_id) -> dict``, like an engine's code that works on
  vLLM prompt dicts. Pass the converter that builds the caller's dict from a record,
  ``to_dict=omni_requests_vllm.to_vllm`` for vLLM's shape. The checks read keys from
  the returned dict's ``multi_modal_uuids`` and the media it sends from its
  ``multi_modal_data``, which must hold the caller's items in their places
  (``media_kept``): a key is judged for the caller's item, so it must be sent with it.

Either kind may return ``(replica_id, result)`` instead of the result, for functions that
choose or change the replica; the returned id is the one the keys must name.

The converter is a parameter rather than an import because this module belongs to the
core, which never imports an adapter: the core knows records, an adapter knows an
engine's dicts, and the caller, who knows both, joins them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final, Protocol

import attrs
import numpy as np
from hypothesis import HealthCheck, given
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from pyrsistent import PVector, pvector

from ._errors import type_name
from ._exif import copy_with_exif, parser_tags
from ._keys import looks_scoped
from ._media import MediaKind, media_kind, tensor_bytes
from ._records import SINGLE_KINDS, SinglePrompt, _summary, values_equal
from ._scoping import rendered_uuids
from .strategies import TemplateCopies, media_identity, prompts, templates_with_copies

__all__ = ["PROPERTIES", "ScopingPropertyError", "check_scoping"]

PROPERTIES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "caller_unchanged": "the caller's prompt is unchanged, deep: nested maps, lists and media bytes",
        "distinct_media_distinct_keys": "items with different media (or UUIDs) get different keys",
        "equal_media_equal_keys": "items with equal media (or UUIDs) on one replica get equal keys",
        "replicas_distinct_keys": "no key is used on two replicas",
        "one_scope_prefix": "every key has exactly one scope prefix, naming the stage and the replica",
        "rescoping_keeps_base": "a used, copied or retried prompt gets the base a fresh prompt gets",
        "user_uuids_kept": "an item's user UUID is its key's base, unchanged",
        "none_items_kept": "a None (cached-only) item stays None in the scoped prompt",
        "media_kept": "each item sent is the caller's item in that place, the one its key is for",
    }
)
"""The properties :func:`check_scoping` checks, name to statement, in the order it runs them."""

_PREFIX: Final = re.compile(r"stage(\d+):rep(\d+):")
_HEX: Final = re.compile(r"[0-9a-f]{32,}")


class ScopingPropertyError(AssertionError):
    """A scoping function broke one or more of :data:`PROPERTIES`.

    ``properties`` names them; the message holds, for each, the shrunk counter-example:
    the prompts, every call made, the keys each call gave, and what is wrong with them.
    """

    def __init__(self, properties: Sequence[str], message: str) -> None:
        self.properties = tuple(properties)
        super().__init__(message)


# -- the scenario: a used template, its copies, an equal rebuild, and calls -------------


@attrs.frozen
class _Call:
    source: int
    """0 is the template, 1..N the copies, N + 1 the template rebuilt from equal media."""
    replica: int
    feed_back: bool
    """Records only: scope the last result for this source again (a retry of a scoped record)."""


@attrs.frozen(repr=False)
class _Scenario:
    template: SinglePrompt
    copies: tuple[SinglePrompt, ...]
    rebuilt: SinglePrompt
    calls: tuple[_Call, ...]

    @property
    def sources(self) -> tuple[SinglePrompt, ...]:
        return (self.template, *self.copies, self.rebuilt)

    def name(self, source: int) -> str:
        if source == 0:
            return "template"
        if source <= len(self.copies):
            return f"copy {source}"
        return "rebuilt"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # Hypothesis prints a failing example with its own printer, which would list an
        # attrs class field by field; this keeps it to the summary below.
        printer.text(repr(self))

    def __repr__(self) -> str:
        lines = ["prompts:"]
        used = {call.source for call in self.calls}
        for i, record in enumerate(self.sources):
            if i not in used:
                continue
            note = ""
            if 0 < i <= len(self.copies):
                note = " (attrs.evolve of the template with new media)"
            elif i == len(self.copies) + 1:
                note = " (the template built again from equal copies of its media)"
            lines.append(f"  {self.name(i)}{note}: {_describe_record(record)}")
        lines.append("calls:")
        for step, call in enumerate(self.calls, start=1):
            again = ", its last result fed back" if call.feed_back else ""
            lines.append(f"  {step}. fn({self.name(call.source)}{again}, replica {call.replica})")
        return "\n".join(lines)


def _describe_item(modality: str, item: object, uuid: str | None) -> str:
    if item is None:
        return f"None uuid={uuid!r}"
    text = f"{_summary(item)}#{_tag(media_identity(modality, item))}"
    return text if uuid is None else f"{text} uuid={uuid!r}"


def _tag(identity: tuple[str, ...]) -> str:
    return identity[-1][:6] if identity[0] == "content" else identity[-1][:8]


def _describe_record(record: SinglePrompt) -> str:
    parts = [type(record).__name__]
    uuids = record.multi_modal_uuids
    for modality, items in record.multi_modal_data.items():
        given = uuids.get(modality)
        shown = [
            _describe_item(modality, item, None if given is None else given[i])
            for i, item in enumerate(items)
        ]
        parts.append(f"{modality}=[{', '.join(shown)}]")
    for modality, given in uuids.items():
        if modality not in record.multi_modal_data:
            parts.append(f"{modality}=(no data, ignored by vLLM) uuids={list(given)!r}")
    return " ".join(parts)


def _short(value: object) -> str:
    return _HEX.sub(lambda m: m.group(0)[:8] + "…", repr(value))


@st.composite
def _scenarios(
    draw: st.DrawFn,
    templates: st.SearchStrategy[TemplateCopies],
    replicas: int,
    max_calls: int,
    feed_back: bool,
) -> _Scenario:
    """The story of the bug, then retries: the template is used, each copy is sent, and
    then any prompt (the equal rebuild too) is sent again to any replica. With
    ``feed_back`` a retry may send the last result instead (records only: a dict
    caller retries with its own dict)."""
    template, copies = draw(templates)
    count = len(copies) + 2
    replica = st.integers(0, replicas - 1)
    story = [_Call(source, draw(replica), False) for source in range(len(copies) + 1)]
    again = st.booleans() if feed_back else st.just(False)
    calls = st.builds(_Call, st.integers(0, count - 1), replica, again)
    rest = draw(st.lists(calls, min_size=1, max_size=max(1, max_calls - len(story))))
    return _Scenario(template, tuple(copies), _rebuild(template), (*story, *rest))


# -- copies of media: equal content in new objects ------------------------------------


def _copy_media(value: object) -> Any:
    """``value`` with every container, array, image and tensor replaced by an equal new one.

    Arrays come back writable, as a user's own arrays are.
    """
    media: Any = value
    kind = media_kind(value)
    if kind is MediaKind.ARRAY:
        return np.array(media, copy=True, order="K")
    if kind is MediaKind.IMAGE:
        return copy_with_exif(media)  # Image.copy() drops EXIF set in memory; vLLM keys on it
    if kind is MediaKind.TENSOR:
        return media.clone()
    if kind is MediaKind.SEQUENCE:
        copies = [_copy_media(v) for v in media]
        return tuple(copies) if isinstance(media, tuple) else copies
    if kind is MediaKind.MAPPING:
        return {k: _copy_media(v) for k, v in media.items()}
    return value


def _rebuild(record: SinglePrompt) -> SinglePrompt:
    data = {m: pvector([_copy_media(item) for item in items]) for m, items in record.multi_modal_data.items()}
    rebuilt: SinglePrompt = attrs.evolve(record, multi_modal_data=data)
    return rebuilt


# -- worlds: how a caller holds prompts, and how a result is read -------------------------


@attrs.frozen
class _Result:
    replica: int
    keys: Mapping[str, Any] | None
    data: Mapping[str, Any] | None
    payload: object


class _World(Protocol):
    def make(self, record: SinglePrompt) -> object: ...

    def copy(self, used_template: object, record: SinglePrompt, changed: Sequence[str]) -> object: ...

    def call(self, fn: Callable[[Any, int], Any], prompt: object, replica: int) -> _Result: ...


def _split_result(result: object, replica: int) -> tuple[int, object]:
    if result is None:
        raise TypeError(
            "the scoping function returned None; a function that scopes the caller's prompt in "
            "place can be checked through a wrapper that returns it, "
            "lambda prompt, replica: (fn(prompt, replica), prompt)[1] (caller_unchanged will fail)"
        )
    if isinstance(result, tuple) and len(result) == 2:
        chosen = result[0]
        if isinstance(chosen, (int, np.integer)) and not isinstance(chosen, bool):
            return int(chosen), result[1]
    return replica, result


class _Records:
    """Prompts are records; a copy is ``attrs.evolve`` of the template."""

    def make(self, record: SinglePrompt) -> object:
        return record

    def copy(self, used_template: object, record: SinglePrompt, changed: Sequence[str]) -> object:
        template: Any = used_template
        return attrs.evolve(template, **{name: getattr(record, name) for name in changed})

    def call(self, fn: Callable[[Any, int], Any], prompt: object, replica: int) -> _Result:
        replica, out = _split_result(fn(prompt, replica), replica)
        if not isinstance(out, SINGLE_KINDS):
            raise TypeError(f"the scoping function returned {type_name(out)}, expected a prompt record")
        return _Result(replica, rendered_uuids(out), out.multi_modal_data, out)


@attrs.frozen
class _Dicts:
    """Prompts are plain dicts built by ``to_dict``, holding writable arrays like a user's.

    A copy is the used template's dict, shallowly copied, with the changed fields
    replaced: ``{**template, "multi_modal_data": new}``, the way engine code reuses one.
    """

    to_dict: Callable[[SinglePrompt], Mapping[str, Any]]

    def make(self, record: SinglePrompt) -> object:
        return _copy_media(self.to_dict(record))

    def copy(self, used_template: object, record: SinglePrompt, changed: Sequence[str]) -> object:
        copy = dict(used_template)  # type: ignore[call-overload]
        fresh = self.to_dict(record)
        for name in changed:
            if name in fresh:
                copy[name] = _copy_media(fresh[name])
            else:
                copy.pop(name, None)
        return copy

    def call(self, fn: Callable[[Any, int], Any], prompt: object, replica: int) -> _Result:
        replica, out = _split_result(fn(prompt, replica), replica)
        if not isinstance(out, Mapping):
            raise TypeError(f"the scoping function returned {type_name(out)}, expected a prompt dict")
        keys = out.get("multi_modal_uuids")
        data = out.get("multi_modal_data")
        return _Result(
            replica,
            {m: _as_list(v) for m, v in keys.items()} if isinstance(keys, Mapping) else None,
            {m: _as_list(v) for m, v in data.items()} if isinstance(data, Mapping) else None,
            out,
        )


def _as_list(value: object) -> list[Any]:
    return list(value) if isinstance(value, (list, PVector)) else [value]


# -- snapshots: a deep, comparable picture of a prompt ----------------------------------


def _snapshot(value: object) -> Any:
    if attrs.has(type(value)):
        fields = attrs.fields(type(value))  # type: ignore[arg-type]
        return (
            "record",
            type(value).__name__,
            tuple((f.name, _snapshot(getattr(value, f.name))) for f in fields),
        )
    media: Any = value
    kind = media_kind(value)
    if kind is MediaKind.MAPPING:
        return ("map", tuple((k, _snapshot(v)) for k, v in media.items()))
    if kind is MediaKind.SEQUENCE:
        return (type(value).__name__, tuple(_snapshot(v) for v in media))
    if kind is MediaKind.ARRAY:
        # Writeable too: a function that freezes the caller's array changes the caller's.
        return ("ndarray", media.dtype.str, media.shape, media.tobytes(), media.flags.writeable)
    if kind is MediaKind.IMAGE:
        # Everything vLLM's parser reads: pixels, palette, EXIF orientation and ImageID,
        # and info (transparency), each a part a changed image is reported by.
        palette = media.palette
        colors = None if palette is None else (bytes(palette.palette), palette.rawmode, palette.mode)
        try:
            tags: object = repr(sorted(parser_tags(media).items()))
        except Exception:  # noqa: BLE001 - malformed EXIF, which vLLM's parser tolerates too
            tags = "malformed"
        parts = (media.mode, media.size, media.tobytes(), colors, tags, _snapshot(dict(media.info)))
        return ("image", *zip(_IMAGE_PARTS, parts, strict=True))
    if kind is MediaKind.TENSOR:
        raw = tensor_bytes(media).tobytes()
        return ("tensor", str(media.dtype), tuple(media.shape), raw)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, complex):
        return ("complex", value.real.hex(), value.imag.hex())
    if value is None or isinstance(value, (str, bytes, bool, int)):
        return value
    return ("object", type_name(value), repr(value))


_IMAGE_PARTS: Final = ("mode", "size", "pixels", "palette", "EXIF orientation and ImageID", "info")


def _shown(snapshot: Any) -> str:
    if isinstance(snapshot, tuple) and snapshot:
        tag = snapshot[0]
        if tag == "map":
            return "{" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in snapshot[1]) + "}"
        if tag in ("list", "tuple", "pvector"):
            return "[" + ", ".join(_shown(v) for v in snapshot[1]) + "]"
        if tag in ("ndarray", "image", "tensor", "record"):
            return f"<{tag}>"
        if tag in ("float", "complex", "object"):
            return str(snapshot[1:])
    return _short(snapshot)


def _difference(before: Any, after: Any, path: str = "$") -> str | None:
    """Where two snapshots first differ, as ``path: was X, now Y``; None when equal."""
    if before == after:
        return None
    if isinstance(before, tuple) and isinstance(after, tuple) and before[:1] == after[:1] and before:
        tag = before[0]
        if tag in ("map", "record"):
            old, new = dict(before[-1]), dict(after[-1])
            for key in [*old, *(k for k in new if k not in old)]:
                if key not in new:
                    return f"{path}.{key}: removed (was {_shown(old[key])})"
                if key not in old:
                    return f"{path}.{key}: added, now {_shown(new[key])}"
                found = _difference(old[key], new[key], f"{path}.{key}")
                if found:
                    return found
        elif tag in ("list", "tuple", "pvector") and len(before[1]) == len(after[1]):
            for i, (old_item, new_item) in enumerate(zip(before[1], after[1], strict=True)):
                found = _difference(old_item, new_item, f"{path}[{i}]")
                if found:
                    return found
        elif tag == "image":
            parts = zip(before[1:], after[1:], strict=True)
            changed = [name for (name, old_part), (_, new_part) in parts if old_part != new_part]
            return f"{path}: the image's {' and '.join(changed)} changed"
        elif tag in ("ndarray", "tensor"):
            return f"{path}: the {tag}'s content changed"
    return f"{path}: was {_shown(before)}, now {_shown(after)}"


# -- running a scenario -------------------------------------------------------------------


@attrs.frozen
class _Item:
    modality: str
    index: int
    uuid: str | None
    is_none: bool
    identity: tuple[str, ...]
    # What the engine tells apart: the identity of the item as vLLM's parser hands it on
    # (an image turned upright and flattened to RGB). Distinct media must get distinct
    # keys only where this differs; equal media must get equal keys where identity is equal.
    seen: tuple[str, ...]
    # The item's content, as vLLM's hasher reads it and as the model sees it, its user UUID
    # aside: what the scoped prompt must send in this place (a UUID names media, it is not it).
    content: tuple[tuple[str, ...], tuple[str, ...]]

    @property
    def where(self) -> str:
        return f"{self.modality}[{self.index}]"


def _items(record: SinglePrompt) -> list[_Item]:
    """The items the engine keys: one per entry of ``multi_modal_data``, ``None`` included.

    UUIDs of a modality with no data are not items: vLLM accepts them and ignores them
    (no item, so no key), so a scoping function may leave them as they are, as
    vllm-omni's own helper does, or scope or drop them.
    """
    items = []
    uuids = record.multi_modal_uuids
    for modality, values in record.multi_modal_data.items():
        given = uuids.get(modality)
        for i, value in enumerate(values):
            uuid = None if given is None else given[i]
            identity = media_identity(modality, value, uuid)
            seen = media_identity(modality, value, uuid, parsed=True)
            items.append(
                _Item(
                    modality,
                    i,
                    uuid,
                    value is None,
                    identity,
                    seen,
                    _content_of(modality, value) if uuid is not None else (identity, seen),
                )
            )
    return items


def _content_of(modality: str, value: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return media_identity(modality, value), media_identity(modality, value, parsed=True)


@attrs.frozen
class _Observation:
    step: int
    source: int
    requested: int
    result: _Result
    items: tuple[_Item, ...]

    def key(self, item: _Item) -> object:
        keys = self.result.keys
        row = None if keys is None else keys.get(item.modality)
        return row[item.index] if row is not None and item.index < len(row) else _MISSING


class _Missing:
    def __repr__(self) -> str:
        return "(no key)"


_MISSING: Final = _Missing()


@attrs.frozen
class _Trace:
    scenario: _Scenario
    observations: tuple[_Observation, ...]
    changes: tuple[str, ...]

    def label(self, obs: _Observation, item: _Item | None = None) -> str:
        name = self.scenario.name(obs.source)
        where = "" if item is None else f" {item.where}"
        return f"step {obs.step}: {name}{where} on replica {obs.result.replica}"

    def steps(self) -> str:
        lines = []
        for obs in self.observations:
            call = self.scenario.calls[obs.step - 1]
            again = ", its last result fed back" if call.feed_back else ""
            chose = "" if obs.result.replica == obs.requested else f" (fn chose replica {obs.result.replica})"
            keys = obs.result.keys
            shown = "no multi_modal_uuids" if keys is None else _short(dict(keys))
            lines.append(
                f"  {obs.step}. fn({self.scenario.name(obs.source)}{again}, replica {obs.requested})"
                f"{chose} -> {shown}"
            )
        return "\n".join(lines)


def _run(fn: Callable[[Any, int], Any], world: _World, scenario: _Scenario) -> _Trace:
    sources = scenario.sources
    callers: dict[int, object] = {}
    last: dict[int, object] = {}
    watched: list[tuple[str, object, Any]] = []
    changes: list[str] = []
    observations = []
    template = scenario.template
    # What each item is, read before any call can change it.
    items = [tuple(_items(record)) for record in sources]
    for step, call in enumerate(scenario.calls, start=1):
        if call.source not in callers:
            record = sources[call.source]
            if 0 < call.source <= len(scenario.copies):
                changed = [
                    f.name
                    for f in attrs.fields(type(record))
                    if not values_equal(getattr(template, f.name), getattr(record, f.name))
                ]
                caller = world.copy(callers.setdefault(0, world.make(template)), record, changed)
            else:
                caller = world.make(record)
            callers[call.source] = caller
            if not any(obj is caller for _, obj, _ in watched):
                watched.append((scenario.name(call.source), caller, _snapshot(caller)))
        prompt = callers[call.source]
        if call.feed_back and call.source in last:
            prompt = last[call.source]
            if not any(obj is prompt for _, obj, _ in watched):
                watched.append((f"{scenario.name(call.source)}'s last result", prompt, _snapshot(prompt)))
        result = world.call(fn, prompt, call.replica)
        last[call.source] = result.payload
        for name, obj, before in watched:
            found = _difference(before, _snapshot(obj))
            if found and not changes:
                changes.append(f"step {step} changed the {name}'s prompt: {found}")
        observations.append(_Observation(step, call.source, call.replica, result, items[call.source]))
    return _Trace(scenario, tuple(observations), tuple(changes))


# -- the properties ------------------------------------------------------------------------


@attrs.frozen
class _Context:
    fn: Callable[[Any, int], Any]
    world: _World
    stage_id: int


def _keyed(trace: _Trace) -> Iterable[tuple[_Observation, _Item, str]]:
    for obs in trace.observations:
        for item in obs.items:
            key = obs.key(item)
            if isinstance(key, str):
                yield obs, item, key


def _base(key: str) -> str:
    match = _PREFIX.match(key)
    return key[match.end() :] if match else key


def _caller_unchanged(trace: _Trace, ctx: _Context) -> str | None:
    return trace.changes[0] if trace.changes else None


def _distinct_media_distinct_keys(trace: _Trace, ctx: _Context) -> str | None:
    seen: dict[str, tuple[_Observation, _Item]] = {}
    for obs, item, key in _keyed(trace):
        first = seen.setdefault(key, (obs, item))
        if first[1].seen != item.seen:
            return (
                f"different media got the same key {_short(key)}:\n"
                f"    {trace.label(*first)} ({_identity(first[1])})\n"
                f"    {trace.label(obs, item)} ({_identity(item)})"
            )
    return None


def _identity(item: _Item) -> str:
    kind, *_, value = item.identity
    return f"user UUID {value!r}" if kind == "user" else f"content #{value[:6]}"


def _equal_media_equal_keys(trace: _Trace, ctx: _Context) -> str | None:
    # Equal both as given and as the model sees them: two images with one EXIF ImageID but
    # other pixels are equal to vLLM's direct hasher, yet the parser drops the ID and the
    # model sees the pixels, so a scoping function may (and ours does) key them apart.
    seen: dict[tuple[int, tuple[str, ...], tuple[str, ...]], tuple[_Observation, _Item, str]] = {}
    for obs, item, key in _keyed(trace):
        first = seen.setdefault((obs.result.replica, item.identity, item.seen), (obs, item, key))
        if first[2] != key:
            return (
                f"equal media ({_identity(item)}) on replica {obs.result.replica} got different keys:\n"
                f"    {trace.label(first[0], first[1])} -> {_short(first[2])}\n"
                f"    {trace.label(obs, item)} -> {_short(key)}"
            )
    return None


def _replicas_distinct_keys(trace: _Trace, ctx: _Context) -> str | None:
    seen: dict[str, tuple[_Observation, _Item]] = {}
    for obs, item, key in _keyed(trace):
        first = seen.setdefault(key, (obs, item))
        if first[0].result.replica != obs.result.replica:
            return (
                f"the key {_short(key)} is used on two replicas:\n"
                f"    {trace.label(*first)}\n    {trace.label(obs, item)}"
            )
    return None


def _one_scope_prefix(trace: _Trace, ctx: _Context) -> str | None:
    for obs in trace.observations:
        expected = f"stage{ctx.stage_id}:rep{obs.result.replica}:"
        for item in obs.items:
            key = obs.key(item)
            label = trace.label(obs, item)
            if not isinstance(key, str):
                return f"{label} has no scoped key: got {_short(key)}"
            match = _PREFIX.match(key)
            if match is None:
                return f"{label} has no scope prefix: {_short(key)} (expected {expected}...)"
            if match.group(0) != expected:
                return f"{label} is scoped to the wrong place: {_short(key)} (expected {expected}...)"
            if looks_scoped(key[match.end() :]):
                return f"{label} has more than one scope prefix: {_short(key)}"
    return None


def _rescoping_keeps_base(trace: _Trace, ctx: _Context) -> str | None:
    sources = trace.scenario.sources
    for obs in trace.observations:
        fresh = ctx.world.call(ctx.fn, ctx.world.make(sources[obs.source]), obs.requested)
        reference = _Observation(obs.step, obs.source, obs.requested, fresh, obs.items)
        for item in obs.items:
            key, fresh_key = obs.key(item), reference.key(item)
            if not isinstance(key, str) or not isinstance(fresh_key, str):
                continue  # a missing key is one_scope_prefix's to report
            if _base(key) != _base(fresh_key):
                return (
                    f"{trace.label(obs, item)} got base {_short(_base(key))}, but a fresh copy of that "
                    f"prompt scoped to replica {obs.requested} gets base {_short(_base(fresh_key))}"
                )
    return None


def _user_uuids_kept(trace: _Trace, ctx: _Context) -> str | None:
    for obs, item, key in _keyed(trace):
        if item.uuid is not None and _base(key) != item.uuid:
            return (
                f"{trace.label(obs, item)} has user UUID {item.uuid!r}, "
                f"but its key {_short(key)} has base {_short(_base(key))}"
            )
    return None


def _none_items_kept(trace: _Trace, ctx: _Context) -> str | None:
    for obs in trace.observations:
        data = obs.result.data
        for item in obs.items:
            if not item.is_none:
                continue
            row = None if data is None else data.get(item.modality)
            label = trace.label(obs, item)
            if row is None or item.index >= len(row):
                return (
                    f"{label} is None (cached only) but is missing from the scoped prompt's multi_modal_data"
                )
            if row[item.index] is not None:
                found = _summary(row[item.index])
                return f"{label} is None (cached only) but the scoped prompt has {found} there"
    return None


def _media_kept(trace: _Trace, ctx: _Context) -> str | None:
    # The keys are judged against the caller's items; the engine caches what the scoped
    # prompt sends under them. A function that keys the caller's media but sends other
    # media (a cache's, a template's) passes every key property and serves stale features.
    # Judged by content, as the key properties judge "equal media": a function may send an
    # equal copy, in another layout or container, but not other pixels, bytes or frames.
    for obs in trace.observations:
        data = obs.result.data
        given: dict[str, int] = {}
        for item in obs.items:
            given[item.modality] = given.get(item.modality, 0) + 1
            if item.is_none:
                continue  # none_items_kept's
            row = None if data is None else data.get(item.modality)
            label = trace.label(obs, item)
            if row is None or item.index >= len(row):
                return f"{label} ({_content_tag(item)}) is missing from the scoped prompt's multi_modal_data"
            sent = row[item.index]
            content = None if sent is None else _content_of(item.modality, sent)
            if content != item.content:
                shown = "None" if content is None else f"{_summary(sent)}#{_tag(content[0])}"
                return (
                    f"{label} is sent as {shown}, but the caller gave {_content_tag(item)} there; "
                    f"its key {_short(obs.key(item))} names the caller's item, not the one sent"
                )
        for modality, row in (data or {}).items():
            if len(row) > given.get(modality, 0):
                extra = row[given.get(modality, 0)]
                return (
                    f"step {obs.step}: the scoped prompt sends {modality}[{given.get(modality, 0)}] "
                    f"({'None' if extra is None else _summary(extra)}), an item the caller did not give"
                )
    return None


def _content_tag(item: _Item) -> str:
    return f"content #{_tag(item.content[0])}"


_CHECKS: Final[Mapping[str, Callable[[_Trace, _Context], str | None]]] = {
    "caller_unchanged": _caller_unchanged,
    "distinct_media_distinct_keys": _distinct_media_distinct_keys,
    "equal_media_equal_keys": _equal_media_equal_keys,
    "replicas_distinct_keys": _replicas_distinct_keys,
    "one_scope_prefix": _one_scope_prefix,
    "rescoping_keeps_base": _rescoping_keeps_base,
    "user_uuids_kept": _user_uuids_kept,
    "none_items_kept": _none_items_kept,
    "media_kept": _media_kept,
}


def _report(name: str, problem: str, trace: _Trace) -> str:
    return (
        f"scoping property {name!r} failed: {PROPERTIES[name]}.\n"
        f"  {problem}\n"
        f"Counter-example (shrunk by Hypothesis):\n"
        + "\n".join("  " + line for line in repr(trace.scenario).splitlines())
        + f"\nkeys each call gave:\n{trace.steps()}"
    )


# -- the entry point -------------------------------------------------------------------------


def check_scoping(
    fn: Callable[[Any, int], Any],
    *,
    to_dict: Callable[[SinglePrompt], Mapping[str, Any]] | None = None,
    properties: Iterable[str] | None = None,
    prompts: st.SearchStrategy[SinglePrompt] | None = None,
    replicas: int = 2,
    stage_id: int = 0,
    max_calls: int = 6,
    settings: Settings | None = None,
) -> None:
    """Check that ``fn`` scopes prompts to replicas safely; raise :class:`ScopingPropertyError` if not.

    ``fn(prompt, replica_id)`` returns the scoped prompt, or ``(replica_id, prompt)``.
    Without ``to_dict`` prompts are records; with it they are the dicts it builds (pass
    ``omni_requests_vllm.to_vllm`` for vLLM's dicts). ``properties`` picks some of
    :data:`PROPERTIES` (default: all). ``prompts`` gives the templates (single prompt
    records with media; default: text and tokens prompts over image, video and audio).
    Each template is copied with new media (see
    :func:`~omni_requests.strategies.templates_with_copies`) and rebuilt from equal
    media; the template is sent, then each copy, then retries of any of them (a record's
    retry may be its own scoped result), ``max_calls`` calls at most, over ``replicas``
    replicas of stage ``stage_id``. ``settings`` are Hypothesis settings for each
    property's search (default: the current profile, with no deadline).

    >>> from functools import partial
    >>> from omni_requests import MediaHasher, scope_to_replica
    >>> ours = partial(scope_to_replica, hasher=MediaHasher("m"))
    >>> check_scoping(ours, settings=Settings(max_examples=5, database=None))
    """
    chosen = _properties(properties)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type_name(fn)}")
    if to_dict is not None and not callable(to_dict):
        raise TypeError(f"to_dict must be callable, got {type_name(to_dict)}")
    for name, value, minimum in (
        ("replicas", replicas, 2),
        ("stage_id", stage_id, 0),
        ("max_calls", max_calls, 3),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if prompts is not None and not isinstance(prompts, st.SearchStrategy):
        raise TypeError(f"prompts must be a Hypothesis strategy, got {type_name(prompts)}")
    world: _World = _Records() if to_dict is None else _Dicts(to_dict)
    base = _default_prompts() if prompts is None else prompts
    most = min(3, max_calls - 2)
    templates = templates_with_copies(prompts=base, max_copies=most) | templates_with_copies(
        prompts=base, max_copies=most, new_uuids=True
    )
    scenarios = _scenarios(templates, replicas, max_calls, to_dict is None)
    config = _settings(settings)
    ctx = _Context(fn, world, stage_id)
    failures: list[ScopingPropertyError] = []
    for name in chosen:
        try:
            _search(name, ctx, scenarios, config)
        except ScopingPropertyError as failure:
            failures.append(failure)
    if len(failures) == 1:
        raise failures[0]
    if failures:
        names = [n for failure in failures for n in failure.properties]
        text = "\n\n".join(str(failure) for failure in failures)
        raise ScopingPropertyError(
            names, f"{len(names)} scoping properties failed: {', '.join(names)}\n\n{text}"
        )


def _properties(properties: Iterable[str] | None) -> tuple[str, ...]:
    if properties is None:
        return tuple(PROPERTIES)
    if isinstance(properties, str):
        properties = [properties]
    chosen = tuple(properties)
    unknown = [name for name in chosen if name not in PROPERTIES]
    if unknown or not chosen:
        raise ValueError(f"properties must be some of {', '.join(PROPERTIES)}; got {chosen!r}")
    return chosen


def _default_prompts() -> st.SearchStrategy[SinglePrompt]:
    strategy: st.SearchStrategy[Any] = prompts(kinds=("text", "tokens"), media=True)
    return strategy


def _settings(given_settings: Settings | None) -> Settings:
    parent = given_settings or Settings.default
    assert parent is not None
    quiet = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
    return Settings(
        parent,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[*parent.suppress_health_check, *quiet],
    )


def _search(name: str, ctx: _Context, scenarios: st.SearchStrategy[_Scenario], config: Settings) -> None:
    check = _CHECKS[name]

    def scoping_property(scenario: _Scenario) -> None:
        trace = _run(ctx.fn, ctx.world, scenario)
        problem = check(trace, ctx)
        if problem is not None:
            raise ScopingPropertyError([name], _report(name, problem, trace))

    scoping_property.__name__ = scoping_property.__qualname__ = name
    # Hypothesis keys its example database by a digest of the inner test function (its
    # source, which every search here shares, plus this attribute, which it reads from
    # that same function): each property and checked function gets its own entry, so a
    # saved failure replays for the function it broke.
    label = f"{name}:{getattr(ctx.fn, '__module__', '')}.{getattr(ctx.fn, '__qualname__', repr(ctx.fn))}"
    scoping_property._hypothesis_internal_add_digest = label.encode()  # type: ignore[attr-defined]
    test = config(given(scenario=scenarios)(scoping_property))
    try:
        test()
    except Flaky as flaky:
        # A failure that did not come again when Hypothesis replayed its example: the
        # function's keys depend on its earlier calls (a cache keyed by id(), whose ids
        # Python hands to new objects). It is still this property's failure.
        failure = _scoping_failure(flaky)
        if failure is None:
            raise
        raise ScopingPropertyError(
            failure.properties,
            f"{failure}\n\nThis failure did not come again when its example was run again: "
            "the function's keys depend on its earlier calls (a cache keyed by id(), say, "
            "whose ids Python gives to new objects).",
        ) from flaky


def _scoping_failure(error: BaseException) -> ScopingPropertyError | None:
    """The first ScopingPropertyError in ``error`` or the exceptions it groups."""
    if isinstance(error, ScopingPropertyError):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = _scoping_failure(inner)
        if found is not None:
            return found
    return None
