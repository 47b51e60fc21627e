"""Drop-in stage-0 scoping for engines with several stage-0 replicas (vllm-omni).

The engine picks a stage-0 replica before preprocessing and scopes every media key to
it, because the frontend's processor cache is one per process while each replica has
its own. :func:`scope_stage0` does that without writing into the caller's prompts:
dicts come back as fresh dicts, records as new records.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Generic, Literal, NamedTuple, TypeGuard, TypeVar, overload

import attrs
import numpy as np

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    OmniRequestsError,
    PromptTypeError,
    scope_to_replica,
)
from omni_requests._adapter_api import (
    SINGLE_KINDS,
    check_index,
    check_uuid,
    image_parses,
    is_pil_image,
    is_torch_tensor,
    key_bases,
    one_request,
    refuse_engine_scoped,
    thaw,
    type_name,
    unreadable,
    unscoped,
    unsealed,
)
from omni_requests_vllm import from_vllm, to_vllm

from ._routing import RouteRequest, SelectReplica, live_replica_id

__all__ = ["Stage0Pool", "Stage0Result", "scope_stage0"]

_T = TypeVar("_T")
_RECORDS = (*SINGLE_KINDS, EncoderDecoderPrompt)
_RECORDS_OR_STR = (*_RECORDS, str)
# What most prompts are, told apart without the abstract Mapping check (a few hundred ns).
_NEVER_MAPPINGS: Final = frozenset((*_RECORDS_OR_STR, list))


def _replica_ids(value: object) -> tuple[int, ...]:
    path = "$.replicas"
    if isinstance(value, int) and not isinstance(value, bool):
        return tuple(range(check_index(path, value)))
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise PromptTypeError(
            path, f"must be a replica count or the live replica ids, got {type_name(value)}"
        )
    ids = tuple(check_index(f"{path}[{i}]", replica) for i, replica in enumerate(value))
    if len(set(ids)) != len(ids):
        raise InvalidPromptError(path, f"replica ids must be distinct, got {list(ids)}")
    return ids


def _types(value: object) -> tuple[type[Any], ...]:
    if isinstance(value, type):
        return (value,)
    if not isinstance(value, Iterable):
        raise PromptTypeError("$.engine_request_types", f"must be a type or types, got {type_name(value)}")
    types = tuple(value)
    for i, kind in enumerate(types):
        if not isinstance(kind, type):
            raise PromptTypeError(f"$.engine_request_types[{i}]", f"must be a type, got {type_name(kind)}")
    return types


def _callable(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not callable(value):
        raise PromptTypeError(f"$.{attribute.name}", f"must be callable, got {type_name(value)}")


def _is_diffusion(value: object) -> bool:
    # A bool, numpy's included; nothing converted: bool("false") is True, and a diffusion
    # pool is never scoped.
    if type(value) is not bool and type(value) is not np.bool_:
        raise PromptTypeError("$.is_diffusion", f"must be a bool, got {type_name(value)}")
    return bool(value)


@attrs.frozen(kw_only=True)
class Stage0Pool:
    """The facts about stage 0 that scoping depends on.

    ``replicas`` are the ids of the live replicas (an ``int`` n stands for ``0..n-1``);
    scoping happens only with more than one. ``select`` picks one for a request (see
    :class:`RouteRequest`), or returns ``None`` when none is serviceable yet, as a
    distributed pool may. ``is_diffusion`` marks a diffusion stage 0, which has no
    processor cache to scope. ``engine_request_types`` name prompt types that are
    already engine requests; vLLM's ``EngineCoreRequest`` is always recognised.

    Build one per request from the engine's pool (it is a few attributes), so
    membership changes are seen at once.
    """

    replicas: tuple[int, ...] = attrs.field(converter=_replica_ids)
    select: SelectReplica = attrs.field(validator=_callable)
    is_diffusion: bool = attrs.field(default=False, converter=_is_diffusion)
    engine_request_types: tuple[type[Any], ...] = attrs.field(default=(), converter=_types)


class Stage0Result(NamedTuple, Generic[_T]):
    """The chosen replica (``None``: nothing was scoped) and the prompts for ``process_inputs``."""

    replica_id: int | None
    prompts: _T


def _is_engine_request(value: object, extra: tuple[type[Any], ...]) -> bool:
    # An EngineCoreRequest exists only once vllm.v1.engine is imported; never import it here.
    engine = sys.modules.get("vllm.v1.engine")
    kind = getattr(engine, "EngineCoreRequest", None)
    if isinstance(kind, type) and isinstance(value, kind):
        return True
    return bool(extra) and isinstance(value, extra)


def _is_token_list(value: object, path: str) -> bool:
    """Whether ``value`` is a list of token ids; a list whose own code raises as it is read
    is refused at ``path``."""
    if not isinstance(value, list):
        return False
    try:
        return len(value) > 0 and all(
            isinstance(token, int) and not isinstance(token, bool) for token in value
        )
    except Exception as error:  # noqa: BLE001 - whatever a list subclass's own code raises
        raise unreadable(path, error) from None


def _listed(value: Any, path: str) -> list[Any]:
    """``list(value)``, what a sequence's own code raises named at ``path``."""
    try:
        return list(value)
    except Exception as error:  # noqa: BLE001 - whatever a sequence's own code raises
        raise unreadable(path, error) from None


def _batch(prompts: object) -> list[object] | None:
    """The prompts of a batch, or None for one prompt. As vLLM's ``prompt_to_seq`` reads
    it: any sequence but a str, bytes, a mapping or a list of token ids is a batch (a
    tuple too: read as one prompt, its dicts' media went out unscoped)."""
    if (
        not isinstance(prompts, Sequence)
        or isinstance(prompts, (str, bytes, bytearray, memoryview, Mapping))
        or _is_token_list(prompts, "$")
    ):
        return None
    return _listed(prompts, "$")


def _goes_as_read(prompt: object, path: str) -> bool:
    """Whether ``prompt`` goes on as the dict of the record read from it, not as itself.

    vLLM reads a prompt again after the checks (by ``get``, a UUID row by ``len`` and
    ``[i]``, a modality's items by iterating them). A plain dict with plain str keys, its
    UUIDs in plain lists, tuples and strs, answers that read as it answered the checks;
    any other holder's own code could answer otherwise (a list subclass that iterates
    ``["a", "b"]`` and indexes ``"a"`` twice would give two images one cache entry where
    nothing is scoped). Where a UUID repeats, the rule compares the items under it, which
    vLLM reads again too: such a prompt also goes on as what was compared. A plain dict's
    UUID that a record refuses (``check_uuid``) is refused here, at ``path``; the records
    refuse the rest."""
    if type(prompt) in _NEVER_MAPPINGS or not isinstance(prompt, Mapping):
        return False
    if _plain_map(prompt) and "type" in prompt:
        _refuse_scoped_hashes(prompt, path)
        return False  # vLLM takes it as rendered: its keys are its own, read as they are
    return not _read_alike(prompt) or _uuid_repeats(prompt, path, set())


# A content key's shape: the hex digest of blake3 or sha256 (64 digits) or sha512 (128).
_DIGEST: Final = re.compile(r"[0-9a-f]{64}|[0-9a-f]{128}")


def _names_a_digest(prompt: object) -> bool:
    """Whether a record, or a prompt dict read alike (``_read_alike``), gives an item a
    UUID shaped like a content key (in either part of a pair)."""
    if isinstance(prompt, EncoderDecoderPrompt):
        return _names_a_digest(prompt.encoder_prompt) or _names_a_digest(prompt.decoder_prompt)
    if isinstance(prompt, SINGLE_KINDS):
        rows: Iterable[Any] = prompt.multi_modal_uuids.values()
    elif isinstance(prompt, dict):
        if "encoder_prompt" in prompt:
            return any(_names_a_digest(prompt.get(part)) for part in ("encoder_prompt", "decoder_prompt"))
        rows = (prompt.get("multi_modal_uuids") or {}).values()
    else:
        return False
    return any(
        type(uuid) is str and _DIGEST.fullmatch(uuid) is not None for row in rows for uuid in _row(row)
    )


def _refuse_digest_aliases(request: _Request) -> None:
    """Where nothing is scoped, vLLM keys an item without a UUID by its content: refuses a
    UUID that is that key of another item of its prompt, in the library's content key
    (the core refuses it as the prompt is keyed) or in a form vLLM hashes instead
    (``_vllm_forms``). Keys only the prompts with a UUID shaped like a digest (rare)."""
    for index, record in enumerate(request.records):
        if not _names_a_digest(record):
            continue
        request.bases_of(index)
        parts = _parts(record) if isinstance(record, _RECORDS) else []
        for name, part in zip(_PART_NAMES if len(parts) == 2 else ("",), parts, strict=False):
            if part is not None:
                _refuse_part_aliases(part, request.hasher, request._at(index) + name)


def _refuse_part_aliases(part: Any, hasher: MediaHasher, path: str) -> None:
    data = part.multi_modal_data
    digests = {  # a cached-only item (None) names the media it keys: not checked
        uuid: (modality, i)
        for modality, row in part.multi_modal_uuids.items()
        for i, uuid in enumerate(row)
        if uuid is not None and _DIGEST.fullmatch(uuid) and modality in data and data[modality][i] is not None
    }
    if not digests:
        return
    for modality, items in part.multi_modal_data.items():
        given = part.multi_modal_uuids.get(modality)
        for j, item in enumerate(items):
            if item is None or (given is not None and given[j] is not None):
                continue
            for version, keys in _vllm_keys(hasher, modality, item).items():
                for key in keys & digests.keys():
                    named_modality, i = digests[key]
                    if key in _vllm_keys(hasher, named_modality, data[named_modality][i])[version]:
                        continue  # that vLLM keys the named item so too: the UUID adds no collision
                    raise InvalidPromptError(
                        f"{path}.multi_modal_uuids.{named_modality}[{i}]",
                        f"UUID {key!r} is vLLM's key of multi_modal_data[{modality!r}][{j}], which "
                        "is other media; vLLM keys that item by its content, so one of the two "
                        "would be served the other's features. Give this item another UUID",
                    )


# The vLLM versions whose image parsers differ (see image_parses): 0.34, and 0.32 and before.
_VERSIONS: Final = ("0.34", "0.32")


def _vllm_keys(hasher: MediaHasher, modality: str, item: object) -> dict[str, set[str]]:
    """The keys vLLM may give ``item`` (a record's), by vLLM version: ``content_key``, and
    the key of each form its parser may hash instead (one per model-dependent choice: a
    candidate that matches nothing only costs a hash); for an image the versions parse
    apart, each one's key of its parse. One media to vLLM is one key in the same version:
    an image keyed so by 0.34 and other media keyed so by 0.32 are two."""
    plain = thaw(item)
    if modality == "image" and is_pil_image(plain):
        # vLLM keys its parse (none where it cannot parse it: it fails), by an EXIF
        # ImageID the parse kept (one Pillow cannot turn upright); ours is of its pixels.
        parses = image_parses(plain)
        if len(parses) > 1:
            pairs = zip(_VERSIONS, parses, strict=True)
            return {version: {hasher.key(modality, parse)} for version, parse in pairs}
        keys = {hasher.content_key(modality, plain), *(hasher.key(modality, parse) for parse in parses)}
        return dict.fromkeys(_VERSIONS, keys)
    keys = {hasher.content_key(modality, plain)}
    try:
        forms = _vllm_forms(modality, plain)
    except Exception:  # noqa: BLE001 - a form vLLM's parser could not make either
        forms = []
    for form in forms:
        with contextlib.suppress(Exception):  # a form vLLM's hasher would refuse too
            keys.add(hasher.key(modality, form))
    return dict.fromkeys(_VERSIONS, keys)


def _vllm_forms(modality: str, plain: object) -> list[object]:
    forms: list[object] = []
    if modality not in ("video", "audio"):
        # Kept as given by vLLM's parser (a list of images as one item, a custom
        # modality's item), and hashed so, an image by its EXIF ImageID where it has one:
        # our content key is of its pixels.
        forms.append(plain)
    elif modality == "video":
        if isinstance(plain, tuple) and len(plain) == 2:
            plain = plain[0]  # (frames, metadata): the frames alone on most models
            forms.append(plain)
        if isinstance(plain, list):
            forms.append(np.array(plain))  # vLLM stacks a list of frames
    elif modality == "audio":
        # (samples, rate): the samples (resampled to the model's rate: not known here)
        samples = plain[0] if isinstance(plain, tuple) and len(plain) == 2 else plain
        if isinstance(samples, list):
            samples = np.array(samples)
        elif is_torch_tensor(samples):
            samples = samples.detach().cpu().numpy()  # type: ignore[union-attr]
        forms.append(samples)
        if isinstance(samples, np.ndarray) and samples.ndim == 2:
            # A model that takes one channel reduces them, as the model says.
            channels = samples.T if samples.shape[0] > samples.shape[1] else samples
            forms += [
                channels[0],
                np.mean(channels, axis=0),
                np.max(channels, axis=0),
                np.sum(channels, axis=0),
            ]
    return forms


def _refuse_scoped_hashes(rendered: dict[str, Any], path: str) -> None:
    """Refuses a rendered engine input (vLLM's ``process_inputs`` takes a dict with a
    ``type`` as one, and keys its media by its ``mm_hashes`` as given) whose media key is
    scoped to a replica: only stage 0 writes those, so it is an engine's copy, or a
    client's UUID shaped like one (a chat part's ``uuid`` becomes a key as it is), which
    would overwrite that replica's entry for another request. vLLM's renderer makes
    plain dicts and lists of str; anything else is refused too, so vLLM reads the keys
    checked."""
    for where, part in ((path, rendered), *_rendered_parts(rendered, path)):
        hashes = part.get("mm_hashes")
        if hashes is None:
            continue
        if not _plain_map(hashes):
            raise PromptTypeError(
                f"{where}.mm_hashes", f"must be a dict of lists of str, got {type_name(hashes)}"
            )
        for modality, row in hashes.items():
            if type(row) not in (list, tuple) or not all(type(key) is str for key in row):
                raise PromptTypeError(
                    f"{where}.mm_hashes.{modality}", f"must be a list of str, got {type_name(row)}"
                )
            for i, key in enumerate(row):
                refuse_engine_scoped(f"{where}.mm_hashes.{modality}[{i}]", key)


def _rendered_parts(rendered: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    """An encoder-decoder input's two rendered parts, each a plain dict, with their paths."""
    parts = []
    for name in ("encoder_prompt", "decoder_prompt"):
        part = rendered.get(name)
        if part is None:
            continue
        if not _plain_map(part):
            raise PromptTypeError(f"{path}.{name}", f"must be a dict, got {type_name(part)}")
        parts.append((f"{path}.{name}", part))
    return parts


def _read_alike(prompt: object) -> TypeGuard[dict[str, Any]]:
    """Whether a prompt (or pair) and its UUIDs are held by plain dicts with str keys, and
    plain lists, tuples and strs: see ``_goes_as_read``."""
    if not _plain_map(prompt):
        return False
    if "encoder_prompt" in prompt:
        parts = (prompt.get("encoder_prompt"), prompt.get("decoder_prompt"))
        return all(part is None or type(part) is str or _single_read_alike(part) for part in parts)
    return _single_read_alike(prompt)


def _single_read_alike(prompt: object) -> bool:
    if not _plain_map(prompt):
        return False
    data, uuids = prompt.get("multi_modal_data"), prompt.get("multi_modal_uuids")
    if data is not None and not _plain_map(data):
        return False  # whether it holds media at all is its own code's answer
    return uuids is None or (_plain_map(uuids) and all(map(_plain_uuids, uuids.values())))


def _plain_map(value: object) -> TypeGuard[dict[str, Any]]:
    # A key of a str subclass answers a lookup by its own __eq__: any field could be it.
    return type(value) is dict and all(type(key) is str for key in value)


def _plain_uuids(row: object) -> bool:
    if isinstance(row, (list, tuple)):
        return type(row) in (list, tuple) and all(map(_is_uuid, row))
    return _is_uuid(row)


def _is_uuid(value: object) -> bool:
    return value is None or type(value) is str


def _row(row: Any) -> Any:
    """A modality's UUIDs as vLLM reads them: a str is one UUID."""
    return [row] if isinstance(row, str) else row or ()


def _uuid_repeats(prompt: dict[str, Any], path: str, seen: set[str]) -> bool:
    """Refuses a plain dict's UUID that a record refuses (engine-scoped, empty, a policy's
    prefix); True where a UUID repeats one in ``seen`` (which gathers a pair's two parts)."""
    if "encoder_prompt" in prompt:
        repeats = False
        for part in ("encoder_prompt", "decoder_prompt"):
            value = prompt.get(part)
            if type(value) is dict:
                repeats = _uuid_repeats(value, f"{path}.{part}", seen) or repeats
        return repeats
    uuids = prompt.get("multi_modal_uuids")
    if not uuids:
        return False
    repeats = False
    for modality, row in uuids.items():
        where = f"{path}.multi_modal_uuids.{modality}"
        for i, uuid in enumerate(_row(row)):
            if uuid is not None:
                check_uuid(f"{where}[{i}]", uuid)  # what a record refuses in a UUID
                repeats = repeats or uuid in seen
                seen.add(uuid)
    return repeats


def carries_media(prompt: object) -> bool:
    """Whether ``prompt`` has ``multi_modal_data``, read the way the engine reads it.

    A caller's mapping whose own code raises as it is read is refused by name
    (:class:`~omni_requests.PromptTypeError`, e.g. at ``$.multi_modal_data``)."""
    if isinstance(prompt, SINGLE_KINDS):
        return bool(prompt.multi_modal_data)
    if isinstance(prompt, EncoderDecoderPrompt):
        return carries_media(prompt.encoder_prompt) or carries_media(prompt.decoder_prompt)
    if not isinstance(prompt, Mapping):
        return False
    # Each read of the caller's mapping is named where its own code raises (try costs
    # nothing when nothing raises: plain dicts, on every request's path, pay nothing).
    try:
        pair = "encoder_prompt" in prompt
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$", error) from None
    if pair:
        return _part_carries_media(prompt, "encoder_prompt") or _part_carries_media(prompt, "decoder_prompt")
    try:
        data = prompt.get("multi_modal_data")
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable("$.multi_modal_data", error) from None
    if type(data) is dict or data is None:
        return bool(data)  # a plain dict's length: no code of the caller's
    try:
        return bool(data)
    except Exception as error:  # noqa: BLE001 - whatever its own __bool__ or __len__ raises
        if isinstance(error, (ValueError, RuntimeError)) and not isinstance(data, Mapping):
            return True  # an array or tensor of several values, not a map: converting it refuses it by name
        raise unreadable("$.multi_modal_data", error) from None


def _part_carries_media(prompt: Mapping[Any, object], part: str) -> bool:
    try:
        value = prompt.get(part)
    except Exception as error:  # noqa: BLE001 - whatever a mapping's own code raises
        raise unreadable(f"$.{part}", error) from None
    try:
        return carries_media(value)
    except OmniRequestsError as error:
        raise error.under(f"$.{part}") from None


def _any_carries_media(items: list[object], many: bool) -> bool:
    """Whether some item carries media (the first that does ends the search); an item that
    cannot be read is refused at its index."""
    for i, item in enumerate(items):
        try:
            if carries_media(item):
                return True
        except OmniRequestsError as error:
            raise (error.under(f"$[{i}]") if many else error) from None
    return False


_PART_NAMES: Final = (".encoder_prompt", ".decoder_prompt")
_DEFAULT_POLICY: Final = KeyPolicy()


def _scopes(item: object) -> list[Any]:
    """The scopes of a record's parts (none for a dict, a str or tokens)."""
    parts = _parts(item) if isinstance(item, _RECORDS) else []
    return [part.scope for part in parts if part is not None and part.scope is not None]


def _unscoped(prompts: object, batch: list[object] | None, why: str | None, as_dicts: bool) -> object:
    """``prompts`` as they go on where nothing is scoped: each scoped record unscoped (its
    old scope would send its keys as scoped to a replica the request may not go to, the old
    media's there), and with ``as_dicts`` each record as its dict. ``why``: nothing is
    scoped because no replica was chosen, so a record with media under a policy is refused
    (unscoped, it would go out without its protection)."""
    items = [prompts] if batch is None else batch
    changed = [isinstance(item, _RECORDS) and (as_dicts or bool(_scopes(item))) for item in items]
    if not any(changed):
        return prompts  # the caller's own object, as documented
    if why is not None:
        for i, item in enumerate(items):
            for scope in _scopes(item):
                if scope.policy != _DEFAULT_POLICY and carries_media(item):
                    raise InvalidPromptError(
                        "$" if batch is None else f"$[{i}]",
                        f"is scoped under {scope.policy!r}, and {why}: sent unscoped it would "
                        "lose its policy; send it again once stage 0 can take it",
                    )
    handed = [_handed(item, as_dicts) if it else item for item, it in zip(items, changed, strict=True)]
    return _like(prompts, handed, batch is not None)


def _handed(record: Any, as_dicts: bool) -> object:
    """A record as it goes on unscoped: its dict with ``as_dicts``."""
    plain = unscoped(record) if _scopes(record) else record
    return to_vllm(plain) if as_dicts else plain


def _as_read(
    request: _Request, prompts: object, many: bool
) -> tuple[list[object], list[object] | None, object]:
    """The call as read (``_Request.dicts_as_read``): its items, its batch (None for one
    prompt), and what goes on in the form of ``prompts``."""
    items = request.dicts_as_read()
    return items, items if many else None, _like(prompts, items, many)


def _like(prompts: object, items: list[object], many: bool) -> object:
    """``items`` in the form of ``prompts``: a tuple for a tuple batch, a list for any other
    batch, the one item for one prompt."""
    return (tuple(items) if isinstance(prompts, tuple) else items) if many else items[0]


def _parts(record: object) -> list[Any]:
    """The single prompts inside a record (two for an encoder-decoder prompt)."""
    if isinstance(record, EncoderDecoderPrompt):
        return [record.encoder_prompt, record.decoder_prompt]
    return [record]


class _Request:
    """One request's prompts, checked, with their media keys computed at most once."""

    def __init__(self, items: list[object], hasher: MediaHasher, at: Callable[[int], str]) -> None:
        self.hasher = hasher
        self.items = items
        self._at = at
        self.records: list[object] = []
        # A dict comes back as a dict: its record lives only in this call, so its images
        # and tensors are the caller's, not sealed copies, and a caller's object in two
        # dicts becomes one item, hashed once.
        with unsealed():
            for i, item in enumerate(items):
                if isinstance(item, _RECORDS_OR_STR):
                    self.records.append(item)
                elif isinstance(item, list) and _is_token_list(tokens := _listed(item, at(i)), at(i)):
                    # Read once, here: this copy goes out (a list's own code runs no more).
                    self.records.append(tokens)
                elif isinstance(item, Mapping):
                    try:
                        self.records.append(from_vllm(item))
                    except OmniRequestsError as error:
                        raise error.under(at(i)) from None
                else:
                    raise PromptTypeError(
                        at(i),
                        "must be a prompt dict, a prompt record, a str or a list of token ids "
                        f"to be scoped, got {type_name(item)}",
                    )
        self._bases: dict[int, list[tuple[str, ...]]] = {}

    def dicts_as_read(self) -> list[object]:
        """The items, each mapping as the dict of its record (a fresh plain dict)."""
        records: list[Any] = self.records  # a mapping's record is one
        return [
            to_vllm(record) if isinstance(item, Mapping) else item
            for item, record in zip(self.items, records, strict=True)
        ]

    def bases_of(self, index: int) -> list[tuple[str, ...]]:
        """The unscoped key bases of item ``index``, per part (none for a missing part)."""
        found = self._bases.get(index)
        if found is None:
            record = self.records[index]
            if isinstance(record, EncoderDecoderPrompt):
                # A pair is scoped under one policy, which either part may carry: a
                # conflict, or a part the other's policy cannot bind, fails only when the
                # pair is scoped. Scoped here first (to any replica: the checks do not
                # depend on it), it fails before a replica is bound.
                try:
                    scope_to_replica(record, 0, hasher=self.hasher)
                except OmniRequestsError as error:
                    raise error.under(self._at(index)) from None
            parts = _parts(record) if isinstance(record, _RECORDS) else []
            found = []
            for name, part in zip(_PART_NAMES if len(parts) == 2 else ("",), parts, strict=False):
                if part is None:
                    continue
                try:
                    found.append(key_bases(part, self.hasher))
                except OmniRequestsError as error:  # an item that cannot be keyed, named in the request
                    raise error.under(self._at(index) + name) from None
            self._bases[index] = found
        return found

    def bases(self) -> list[str]:
        """Every key's base, item by item, modalities in name order (stable across processes)."""
        return [base for index in range(len(self.records)) for part in self.bases_of(index) for base in part]

    def scoped(self, index: int, replica_id: int, as_dicts: bool) -> object:
        """Item ``index`` scoped to the replica: records through ``scope_to_replica`` (which
        keeps a policy the record carries), dicts (and records when ``as_dicts``) as the
        dict of their scoped record."""
        item, record = self.items[index], self.records[index]
        if isinstance(item, str):
            return item
        if type(record) is list:
            return list(record)  # a token list, copied in __init__
        prompt: Any = record  # a record: dicts were read into one in __init__
        scoped = scope_to_replica(prompt, replica_id, hasher=self.hasher)
        return scoped if isinstance(item, _RECORDS) and not as_dicts else to_vllm(scoped)


@overload
def scope_stage0(
    prompts: _T,
    *,
    pool: Stage0Pool,
    hasher: MediaHasher,
    request_id: str | None = None,
    as_dicts: Literal[False] = False,
) -> Stage0Result[_T]: ...
@overload
def scope_stage0(
    prompts: object,
    *,
    pool: Stage0Pool,
    hasher: MediaHasher,
    request_id: str | None = None,
    as_dicts: bool,
) -> Stage0Result[Any]: ...
def scope_stage0(
    prompts: object,
    *,
    pool: Stage0Pool,
    hasher: MediaHasher,
    request_id: str | None = None,
    as_dicts: bool = False,
) -> Stage0Result[Any]:
    """Pick a stage-0 replica for a request and scope its media keys to it.

    ``prompts`` is what the engine would hand to ``process_inputs``: one prompt or a
    batch of them (a list or tuple, any ``Sequence`` vLLM reads as a batch; a tuple comes
    back as a tuple), as vLLM/vllm-omni dicts or as records. The result is
    ``(replica_id, prompts)``:

    - scoped: every media key becomes ``stage0:rep{R}:{base}``, where the base is the
      item's user UUID or its content hash (``hasher``: the engine's model string and
      hash algorithm). All prompts of the request get the same replica. Dicts come back
      as new dicts (lists and dicts inside are new too), records as new records, strs
      and token lists as they are (a token list copied). Nothing of the caller's
      changes, so a template dict can be reused and a retry scoped again.
    - passed through, ``(None, prompts)`` with ``prompts`` itself: stage 0 has one
      live replica (or none) or is a diffusion stage; ``prompts`` is already an engine
      request; no prompt carries ``multi_modal_data`` (a rendered input, a dict with a
      ``type``, carries ``mm_hashes`` instead, made before a replica was chosen: one
      scoped to a replica, or not held by plain dicts and lists of str, is refused by
      name); or ``pool.select`` returned ``None``. A record scoped earlier (a retry) is
      never passed on in its old scope, whose keys would name the old replica's cache:
      with one live replica it is scoped to that one (with the request's other
      prompts), and elsewhere it comes back unscoped (in a new list where it is in a
      batch), or, when it carries media and a
      :class:`~omni_requests.KeyPolicy` and no replica could be chosen (none live,
      ``select`` returned ``None``), it is refused by name rather than sent without it.
      A scoped record without media (its UUIDs key nothing) comes back unscoped.
      Except on a diffusion stage, a prompt goes on as the dict of the record read from
      it, not as itself, wherever vLLM's second read of it could find other UUIDs or
      media than the checks did: a mapping that is not a plain dict with str keys, UUIDs
      held by anything but plain dicts, lists, tuples and strs (a list subclass, a
      mapping proxy), media held by a mapping that is no plain dict, or a UUID that
      repeats (the rule compares the items under it, which vLLM reads again). The
      call's prompts are then all read as records, in order, and every dict goes on as
      read, since reading ran the caller's code; so do the dicts where ``select`` was
      asked and returned ``None``, and where a UUID shaped like a content key made the
      call be keyed (keying, an image's own loader and ``select`` are the caller's code
      too). A batch that is no list or tuple comes back as the list that was read.

    With ``as_dicts=True`` every record comes back as a dict (``to_vllm`` of the record,
    scoped or not), on every road: what ``process_inputs`` takes.

    Every dict is checked (``from_vllm``) and every item keyed before ``pool.select``
    is called, so a bad prompt raises (naming e.g. ``$[1].multi_modal_uuids.image``)
    before a replica is bound to the request.

    Each media item is hashed at most once in a call: the keys a policy reads to route
    the request are the ones its dicts are rendered with (``one_request``), never kept
    beyond the call; one object given in several dicts of the call is one item, read once,
    when the first of them is (changed by a later dict's own code, it is not read again). A
    record's keys are cached across calls (its arrays are immutable, its images and
    tensors sealed). A PIL image or tensor in a dict is the caller's own object, hashed
    in each call and handed on: changed during the call (by the policy, or by another
    thread) or after it, before the engine has read it, it goes out under the key of
    what it held when routing read it (``docs/security.md``).

    ``request_id`` (a str, or None) is what ``pool.select`` is told the request is
    (:attr:`RouteRequest.request_id`); anything else is refused by name.

    >>> import numpy as np
    >>> from omni_requests import MediaHasher
    >>> pool = Stage0Pool(replicas=2, select=lambda request: 1)
    >>> prompt = {"prompt": "<image>", "multi_modal_data": {"image": np.zeros((2, 2, 3), np.uint8)},
    ...           "multi_modal_uuids": {"image": ["cat"]}}
    >>> replica, scoped = scope_stage0(prompt, pool=pool, hasher=MediaHasher("m"), request_id="r1")
    >>> replica, scoped["multi_modal_uuids"], prompt["multi_modal_uuids"]
    (1, {'image': ['stage0:rep1:cat']}, {'image': ['cat']})
    """
    if not isinstance(pool, Stage0Pool):
        raise PromptTypeError("pool", f"must be a Stage0Pool, got {type_name(pool)}")
    if not isinstance(hasher, MediaHasher):
        raise PromptTypeError("hasher", f"must be a MediaHasher, got {type_name(hasher)}")
    if not isinstance(as_dicts, bool):
        raise PromptTypeError("as_dicts", f"must be a bool, got {type_name(as_dicts)}")
    if request_id is not None and not isinstance(request_id, str):
        # What a policy is told the request is (RouteRequest.request_id, a str or None).
        raise PromptTypeError("request_id", f"must be a str or None, got {type_name(request_id)}")
    if pool.is_diffusion:
        # No processor cache: no key to keep apart, no policy to keep; the prompts are
        # read no further than a record or a batch of them.
        return Stage0Result(None, _unscoped(prompts, _batch(prompts), None, as_dicts))
    if _is_engine_request(prompts, pool.engine_request_types):
        return Stage0Result(None, prompts)
    batch = _batch(prompts)
    many = batch is not None
    items: list[object] = [prompts] if batch is None else batch
    at: Callable[[int], str] = (lambda i: f"$[{i}]") if many else (lambda _: "$")
    request: _Request | None = None
    if many and type(prompts) not in (list, tuple):
        # vLLM iterates a batch again: what goes on is what was read (a new list).
        prompts = batch
    if any(_goes_as_read(item, at(i)) for i, item in enumerate(items)):
        # Read once, in order, as records (one object in several prompts stays one item).
        # That ran the odd holders' own code, which could change the plain dicts beside
        # them: every dict goes on as its record's dict, whatever road it takes.
        request = _Request(items, hasher, at)
        items, batch, prompts = _as_read(request, prompts, many)
    if len(pool.replicas) <= 1 and not (
        pool.replicas and any(_scopes(item) and carries_media(item) for item in items)
    ):
        # Nothing is scoped. A dict carrying keys an engine scoped (a copy of a scoped dict
        # given new media), refused above, would reach it as they are: the old media's,
        # still cached on that replica when it was one of several. A scoped record with
        # media is scoped to the one replica instead, below: its old scope would be such keys.
        if request is None and any(map(_names_a_digest, items)):
            # Keying for the check below runs the caller's code (an image's own loader),
            # which could change the dicts after their check: they go on as read.
            request = _Request(items, hasher, at)
            items, batch, prompts = _as_read(request, prompts, many)
        if request is not None:
            # vLLM keys the items without a UUID itself: no UUID may be its key of another.
            _refuse_digest_aliases(request)
        why = None if pool.replicas else "stage 0 has no live replica"
        return Stage0Result(None, _unscoped(prompts, batch, why, as_dicts))
    if not _any_carries_media(items, many):
        # Nothing to key: a record scoped earlier still goes on unscoped (or as its dict).
        return Stage0Result(None, _unscoped(prompts, batch, None, as_dicts))

    request = request or _Request(items, hasher, at)
    # One request: routing's keys are the keys its dicts are rendered with.
    with one_request(hasher):
        # Every key first (scoping needs them all anyway): an item that cannot be keyed
        # raises here, by name, before select binds a replica to the request.
        bases = request.bases()
        replica = pool.select(RouteRequest(request_id, pool.replicas, lambda: bases))
        if replica is None:
            _refuse_digest_aliases(request)
            # Keying and select ran the caller's code (a policy, an image's own loader),
            # which could change the dicts since they were checked: they go on as read.
            items, batch, prompts = _as_read(request, prompts, many)
            why = "pool.select chose no replica"
            return Stage0Result(None, _unscoped(prompts, batch, why, as_dicts))
        chosen = live_replica_id(replica, pool.replicas)
        if chosen is None:
            raise InvalidPromptError(
                "$.pool.select",
                f"returned {replica!r} ({type_name(replica)}), which is not a live replica id; "
                f"live replicas: {list(pool.replicas)}",
            )
        scoped = [request.scoped(i, chosen, as_dicts) for i in range(len(items))]
    return Stage0Result(chosen, _like(prompts, scoped, many))
