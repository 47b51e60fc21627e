"""Scoping functions for the property checks: correct ones, the old engine's, and broken ones.

Each broken function is a small, plausible mistake; the tests show which property of
``omni_requests.testing.PROPERTIES`` catches it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omni_requests import MediaHasher, Scope, SinglePrompt, scope_to_replica
from omni_requests_vllm import from_vllm, to_vllm

HASHER = MediaHasher("/models/tiny-vl")

RecordScoper = Callable[[SinglePrompt, int], Any]
DictScoper = Callable[[dict[str, Any], int], Any]

ours: RecordScoper = functools.partial(scope_to_replica, hasher=HASHER)
"""omni-requests' own scoping, as a record function."""


def ours_through_dicts(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """An engine that takes vLLM dicts and scopes them with records at its boundary."""
    return to_vllm(scope_to_replica(from_vllm(prompt), replica, hasher=HASHER))


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _scoped_uuids(
    prompt: dict[str, Any],
    replica: int,
    *,
    stage: int = 0,
    base_of: Callable[[str, Any, str | None], str | None] | None = None,
    prefix: Callable[[int, int], str] = lambda stage, replica: f"stage{stage}:rep{replica}:",
    uuid_only_modalities: bool = True,
) -> dict[str, list[str | None]]:
    """Every item's key, scoped, the way vllm-omni builds them (a helper for the models below)."""

    def default_base(modality: str, item: Any, uuid: str | None) -> str | None:
        if uuid is not None:
            return str(uuid)
        return None if item is None else HASHER.content_key(modality, item)

    base_of = base_of or default_base
    data = prompt.get("multi_modal_data") or {}
    given = prompt.get("multi_modal_uuids") or {}
    scoped: dict[str, list[str | None]] = {} if uuid_only_modalities else dict(given)
    for modality, value in data.items():
        uuids = _as_list(given.get(modality))
        row: list[str | None] = []
        for i, item in enumerate(_as_list(value)):
            base = base_of(modality, item, uuids[i] if i < len(uuids) else None)
            row.append(None if base is None else prefix(stage, replica) + base)
        scoped[modality] = row
    if uuid_only_modalities:
        for modality, value in given.items():
            if modality not in data:  # cached-only items: their keys must name the replica too
                scoped[modality] = [
                    None if u is None else prefix(stage, replica) + str(u) for u in _as_list(value)
                ]
    return scoped


def shallow_copy(prompt: dict[str, Any], replica: int, *, stage: int = 0) -> dict[str, Any]:
    """The upstream fix, done fully: scope a shallow copy and leave the caller's dict alone."""
    if not prompt.get("multi_modal_data") and not prompt.get("multi_modal_uuids"):
        return prompt
    return {**prompt, "multi_modal_uuids": _scoped_uuids(prompt, replica, stage=stage)}


def shallow_copy_choosing(prompt: dict[str, Any], replica: int) -> tuple[int, dict[str, Any]]:
    """Like :func:`shallow_copy`, but the engine picks the replica itself and returns it."""
    chosen = (replica + 1) % 2
    return chosen, shallow_copy(prompt, chosen)


def old_write_back(prompt: dict[str, Any], replica: int, *, stage: int = 0) -> dict[str, Any]:
    """A faithful model of vllm-omni's stage-0 scoping before the upstream fix.

    It prefixes each item's user UUID (or, without one, the content hash) with the
    replica, leaves UUIDs of modalities without data as they were, and *writes the
    scoped dict into the caller's prompt*. The next call reads those scoped keys back
    as user UUIDs: ``stage0:rep1:stage0:rep0:<hash>``.
    """
    data = prompt.get("multi_modal_data")
    if not isinstance(data, dict) or not data:
        return prompt
    prompt["multi_modal_uuids"] = _scoped_uuids(prompt, replica, stage=stage, uuid_only_modalities=False)
    return prompt


# -- broken on purpose, one mistake each -------------------------------------------------


def scope_in_place(prompt: SinglePrompt, replica: int) -> SinglePrompt:
    """Write-back in the record world: forces the scope into the caller's frozen record."""
    object.__setattr__(prompt, "scope", Scope(0, replica, HASHER))
    return prompt


def hash_shape_only(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Keys content by its type and shape, not its bytes."""

    def base(modality: str, item: Any, uuid: str | None) -> str | None:
        if uuid is not None:
            return uuid
        if item is None:
            return None
        shape = getattr(item, "shape", getattr(item, "size", None))  # arrays and tensors; PIL images
        return HASHER.key(modality, f"{type(item).__name__} {shape}")

    return {**prompt, "multi_modal_uuids": _scoped_uuids(prompt, replica, base_of=base)}


def key_by_object_identity(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Keys content by ``id(item)``: equal media in another object gets another key."""

    def base(modality: str, item: Any, uuid: str | None) -> str | None:
        if uuid is not None:
            return uuid
        return None if item is None else f"obj{id(item):x}"

    return {**prompt, "multi_modal_uuids": _scoped_uuids(prompt, replica, base_of=base)}


def cache_by_item_id() -> DictScoper:
    """Remembers each item's key by ``id(item)``, across calls: within one example every
    item stays alive, so only an id Python gives a later example's item tells."""
    cache: dict[tuple[str, int], str] = {}

    def base(modality: str, item: Any, uuid: str | None) -> str | None:
        if uuid is not None:
            return uuid
        if item is None:
            return None
        return cache.setdefault((modality, id(item)), HASHER.content_key(modality, item))

    def scope(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
        return {**prompt, "multi_modal_uuids": _scoped_uuids(prompt, replica, base_of=base)}

    return scope


def freeze_callers_arrays(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Scopes a shallow copy, but sets the caller's arrays read-only on the way."""
    for value in (prompt.get("multi_modal_data") or {}).values():
        for item in _as_list(value):
            if isinstance(item, np.ndarray):
                item.setflags(write=False)
    return shallow_copy(prompt, replica)


def ignore_replica(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Always scopes to replica 0, whichever replica serves the request."""
    return shallow_copy(prompt, 0)


def wrong_stage(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Names stage 1 in every key of a stage-0 request (an off-by-one stage index)."""
    return {**prompt, "multi_modal_uuids": _scoped_uuids(prompt, replica, stage=1)}


def hash_despite_uuid(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Hashes each item's content even where the user gave a UUID."""

    def base(modality: str, item: Any, uuid: str | None) -> str | None:
        return HASHER.key(modality, item)

    return {**prompt, "multi_modal_uuids": _scoped_uuids(prompt, replica, base_of=base)}


def drop_none_items(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Scopes correctly, then drops cached-only (``None``) items from the data it passes on."""
    out = shallow_copy(prompt, replica)
    data = out.get("multi_modal_data")
    if data:
        out["multi_modal_data"] = {m: [x for x in _as_list(v) if x is not None] for m, v in data.items()}
    return out


def stale_media_cache() -> DictScoper:
    """Keys each item right, but sends the media a media cache kept for the prompt's text.

    The cache is keyed by the prompt and its media's layout (modalities, counts, which
    items are None): a template's copies hit the template's entry, so a copy goes out
    with its own keys and the template's pixels, and the engine caches the template's
    features under the copy's keys. Every key property holds; only ``media_kept`` sees
    that a key names another item than the one sent. A new function, a new cache.
    """
    cache: dict[tuple[str, tuple[tuple[str, tuple[bool, ...]], ...]], Any] = {}

    def scope(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
        out = ours_through_dicts(prompt, replica)
        data = out.get("multi_modal_data")
        if data:
            layout = tuple((m, tuple(x is None for x in _as_list(v))) for m, v in data.items())
            text = repr(out.get("prompt", out.get("prompt_token_ids")))
            out["multi_modal_data"] = cache.setdefault((text, layout), data)
        return out

    scope.__name__ = scope.__qualname__ = "stale_media_cache"
    return scope


# -- vllm-omni's own stage-0 helper, as its wheel ships it ---------------------------------


def vllm_omni_helper(model: str = "/models/tiny-vl") -> Callable[..., None]:
    """``AsyncOmniEngine._ensure_stage_replica_mm_uuids`` of the installed vllm-omni, bound.

    Importing ``vllm_omni`` patches vLLM process-wide (and 0.30's package does not import
    beside vLLM 0.34), so this does not import it: it compiles the helper's own source,
    read from the wheel, with the two small methods it calls, into a bare class. The
    helper hashes with the installed vLLM's ``MultiModalHasher``, as in the engine, and
    writes the scoped UUIDs into the dict it is given.
    """
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vllm_omni is not installed", name="vllm_omni")
    source = Path(spec.submodule_search_locations[0], "engine", "async_omni_engine.py")
    tree = ast.parse(source.read_text(encoding="utf-8"))
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AsyncOmniEngine"]
    wanted = {"_ensure_stage_replica_mm_uuids", "_iter_multimodal_items", "_resolve_mm_hasher_algorithm"}
    body: list[ast.stmt] = [
        n
        for n in engine.body
        if (isinstance(n, ast.FunctionDef) and n.name in wanted)
        or (
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "_DEFAULT_MM_HASHER_ALGORITHM" for t in n.targets)
        )
    ]
    if len(body) != len(wanted) + 1:
        raise RuntimeError(f"{source}: the stage-0 helper is not where vllm-omni 0.30 keeps it")
    module = ast.Module(body=[ast.ClassDef("Engine", [], [], body, [], type_params=[])], type_ignores=[])
    namespace: dict[str, Any] = {"Any": Any}
    exec(compile(ast.fix_missing_locations(module), str(source), "exec"), namespace)
    instance = namespace["Engine"]()
    instance.model = model
    helper: Callable[..., None] = instance._ensure_stage_replica_mm_uuids
    return helper


def vllm_omni_write_back(helper: Callable[..., None]) -> DictScoper:
    """vllm-omni 0.30's stage-0 scoping as its engine calls it: on the caller's own dict."""

    def scope(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
        helper(prompt, stage_id=0, replica_id=replica)
        return prompt

    return scope


def vllm_omni_shallow_copy(helper: Callable[..., None]) -> DictScoper:
    """The upstream fix: the same helper, run on a shallow copy of the caller's dict."""

    def scope(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
        copy = dict(prompt)
        helper(copy, stage_id=0, replica_id=replica)
        return copy

    return scope
