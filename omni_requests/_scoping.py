"""Scoping a prompt to a replica, and deriving its media keys.

Scoping only records where the prompt goes; a content key is derived from the media the
record holds *now*, whenever it is asked for. No content key is ever stored, so a record
whose media is replaced (``attrs.evolve`` or otherwise) cannot carry the old media's key.
"""

from __future__ import annotations

from typing import TypeVar

from pyrsistent import PMap, PVector, pmap, pvector

from ._errors import PromptTypeError, type_name
from ._hashing import MediaHasher
from ._keys import KeyOrigin, MediaKey, Scope, check_index
from ._records import _SINGLE, EncoderDecoderPrompt, SinglePrompt, replace_fields

__all__ = ["media_keys", "rendered_uuids", "scope_to_replica"]

_P = TypeVar("_P", bound="SinglePrompt | EncoderDecoderPrompt")


def scope_to_replica(prompt: _P, replica_id: int, *, hasher: MediaHasher, stage_id: int = 0) -> _P:
    """Return ``prompt`` routed to replica ``replica_id`` of stage ``stage_id``.

    Pure: the input is never changed. The result's media keys render as
    ``stage{stage_id}:rep{replica_id}:{base}``, where the base is the item's user UUID or,
    without one, ``hasher.key(modality, item)``. Scoping again replaces the scope, so a
    retry on another replica never gets a second prefix. A prompt without media, or one
    already in this exact scope, is returned as is.

    >>> import numpy as np
    >>> from omni_requests import TextPrompt, MediaHasher, media_keys
    >>> p = TextPrompt(prompt="<image>", multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
    ...                multi_modal_uuids={"image": "cat-1"})
    >>> q = scope_to_replica(p, 1, hasher=MediaHasher("m"))
    >>> media_keys(q)["image"][0].render()
    'stage0:rep1:cat-1'
    >>> media_keys(scope_to_replica(q, 0, hasher=MediaHasher("m")))["image"][0].render()
    'stage0:rep0:cat-1'
    """
    check_index("replica_id", replica_id)
    check_index("stage_id", stage_id)
    if not isinstance(hasher, MediaHasher):
        raise PromptTypeError("hasher", f"must be a MediaHasher, got {type_name(hasher)}")
    if isinstance(prompt, EncoderDecoderPrompt):
        encoder = scope_to_replica(prompt.encoder_prompt, replica_id, hasher=hasher, stage_id=stage_id)
        decoder = prompt.decoder_prompt
        if decoder is not None:
            decoder = scope_to_replica(decoder, replica_id, hasher=hasher, stage_id=stage_id)
        if encoder is prompt.encoder_prompt and decoder is prompt.decoder_prompt:
            return prompt
        scoped: _P = replace_fields(prompt, encoder_prompt=encoder, decoder_prompt=decoder)
        return scoped
    if not isinstance(prompt, _SINGLE):
        raise PromptTypeError("prompt", f"must be a prompt record, got {type_name(prompt)}")
    if not prompt.multi_modal_data and not prompt.multi_modal_uuids:
        return prompt
    scope = Scope(stage_id, replica_id, hasher)
    if prompt.scope == scope:
        return prompt
    result: _P = replace_fields(prompt, scope=scope)
    return result


def _keys(prompt: SinglePrompt, hasher: MediaHasher | None) -> dict[str, list[MediaKey | None]]:
    if not isinstance(prompt, _SINGLE):
        raise PromptTypeError("prompt", f"must be a single prompt record, got {type_name(prompt)}")
    scope = prompt.scope
    if hasher is None and scope is not None:
        hasher = scope.hasher
    data, uuids = prompt.multi_modal_data, prompt.multi_modal_uuids
    keys: dict[str, list[MediaKey | None]] = {}
    for modality, items in data.items():
        given = uuids.get(modality)
        row: list[MediaKey | None] = []
        for i, item in enumerate(items):
            uuid = None if given is None else given[i]
            if uuid is not None:
                row.append(MediaKey(uuid, KeyOrigin.USER, scope))
            elif item is None:
                row.append(None)
            elif hasher is None:
                raise PromptTypeError(
                    "hasher", "an unscoped prompt needs a MediaHasher to derive content keys"
                )
            else:
                row.append(MediaKey(hasher.key(modality, item), KeyOrigin.CONTENT, scope))
        keys[modality] = row
    for modality, given in uuids.items():
        if modality not in data:  # UUIDs of items not sent this time (cached only), as vLLM allows
            keys[modality] = [None if u is None else MediaKey(u, KeyOrigin.USER, scope) for u in given]
    return keys


def media_keys(
    prompt: SinglePrompt, hasher: MediaHasher | None = None
) -> PMap[str, PVector[MediaKey | None]]:
    """Every media item's key, per modality, in item order.

    The hasher defaults to the one the prompt was scoped with; an unscoped prompt needs
    one for items without a user UUID. ``None`` stands for an item that is ``None``
    (cached only) without a UUID.
    """
    return pmap({m: pvector(row) for m, row in _keys(prompt, hasher).items()})


def rendered_uuids(prompt: SinglePrompt) -> dict[str, list[str | None]] | None:
    """The ``multi_modal_uuids`` the engine gets for ``prompt``, or None for none at all.

    Unscoped: the caller's UUIDs as given (vLLM hashes the rest itself). Scoped: every
    item's key rendered with its scope.
    """
    if prompt.scope is None:
        uuids = prompt.multi_modal_uuids
        return {m: list(u) for m, u in uuids.items()} if uuids else None
    if not prompt.multi_modal_data and not prompt.multi_modal_uuids:
        return None
    return {
        m: [None if key is None else key.render() for key in row] for m, row in _keys(prompt, None).items()
    }
