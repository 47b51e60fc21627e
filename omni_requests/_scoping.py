"""Scoping a prompt to a replica, and deriving its media keys.

Scoping only records where the prompt goes; a content key is derived from the media the
record holds. No key is stored with a record's fields, so a record whose media is replaced
(``attrs.evolve`` or otherwise) cannot carry the old media's key; a scope's keys are
remembered only beside the media they were derived from, and only where those can never
read otherwise (see ``rendered_uuids``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, Final, TypeVar

from pyrsistent import PMap, PVector, pmap, pvector

from ._errors import (
    NOT_THE_INPUTS,
    InvalidPromptError,
    OmniRequestsError,
    PromptTypeError,
    confirm_fault,
    type_name,
)
from ._hashing import MediaHasher
from ._keys import _DEFAULT_POLICY, MAX_INDEX, KeyOrigin, KeyPolicy, MediaKey, Scope, check_index, key_text
from ._media import is_frozen_item, plain_map
from ._records import (
    _EMPTY,
    SINGLE_KINDS,
    EncoderDecoderPrompt,
    SinglePrompt,
    check_bindable,
    field_copier,
    replace_fields,
)

__all__ = ["key_bases", "media_keys", "one_request", "rendered_uuids", "scope_to_replica"]

_P = TypeVar("_P", bound="SinglePrompt | EncoderDecoderPrompt")

# Scopes are values; a request scoped to a replica already seen reuses its Scope (and the
# Scope's rendered prefix) instead of building and validating a new one. Bounded: a
# deployment has a handful of stages and replicas, so this only guards against misuse.
_SCOPES: dict[tuple[int, int, int, int], Scope] = {}
_MAX_SCOPES: Final = 4096
# Memo entries per template: one per scope it is rendered in (stages x replicas x policies).
_MAX_MEMO: Final = 64
_WITH_SCOPE: Final[dict[type[Any], Callable[..., Any]]] = {
    kind: field_copier(kind, ("scope",)) for kind in SINGLE_KINDS
}


def _new_scope(stage_id: int, replica_id: int, hasher: MediaHasher, policy: KeyPolicy) -> Scope:
    scope = Scope(stage_id, replica_id, hasher, policy)
    if len(_SCOPES) >= _MAX_SCOPES:
        _SCOPES.clear()
    _SCOPES[(stage_id, replica_id, id(hasher), id(policy))] = scope
    return scope


def scope_to_replica(
    prompt: _P,
    replica_id: int,
    *,
    hasher: MediaHasher,
    stage_id: int = 0,
    policy: KeyPolicy | None = None,
) -> _P:
    """Return ``prompt`` routed to replica ``replica_id`` of stage ``stage_id``.

    Pure: the input is never changed. The result's media keys render as
    ``stage{stage_id}:rep{replica_id}:{base}``, where the base is the item's user UUID or,
    without one, ``hasher.content_key(modality, item)``. Scoping again replaces the scope,
    so a retry on another replica never gets a second prefix. A prompt without media (and
    no policy given), or one already in this exact scope, is returned as is. ``policy``
    (default: none, keys render exactly as vllm-omni renders them) opts in to the protections of
    :class:`KeyPolicy` for user UUIDs. A record already scoped under a policy keeps it:
    ``policy=None`` reuses it, and any other policy is refused, so no later road (a
    retry, an engine's own scoping) can drop a tenant's protection.

    >>> import numpy as np
    >>> from omni_requests import TextPrompt, MediaHasher, media_keys
    >>> p = TextPrompt(prompt="<image>", multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
    ...                multi_modal_uuids={"image": "cat-1"})
    >>> q = scope_to_replica(p, 1, hasher=MediaHasher("m"))
    >>> (key,) = media_keys(q)["image"]
    >>> key.render()
    'stage0:rep1:cat-1'
    >>> (key,) = media_keys(scope_to_replica(q, 0, hasher=MediaHasher("m")))["image"]
    >>> key.render()
    'stage0:rep0:cat-1'
    """
    # Plain ints take the fast road; anything else gets check_index's errors.
    if type(replica_id) is not int or not 0 <= replica_id <= MAX_INDEX:
        replica_id = check_index("replica_id", replica_id)
    if type(stage_id) is not int or not 0 <= stage_id <= MAX_INDEX:
        stage_id = check_index("stage_id", stage_id)
    if type(hasher) is not MediaHasher and not isinstance(hasher, MediaHasher):
        raise PromptTypeError("hasher", f"must be a MediaHasher, got {type_name(hasher)}")
    if policy is not None and type(policy) is not KeyPolicy:  # a subclass could redefine ==
        raise PromptTypeError("policy", f"must be a KeyPolicy or None, got {type_name(policy)}")
    with_scope = _WITH_SCOPE.get(type(prompt))
    if with_scope is None:
        if not isinstance(prompt, SINGLE_KINDS):  # an encoder-decoder pair, or no record
            return _scope_pair(prompt, replica_id, hasher, stage_id, policy)
        with_scope = field_copier(type(prompt), ("scope",))  # a subclass of a record kind
    single: SinglePrompt = prompt  # type: ignore[assignment]  # its type is one of SINGLE_KINDS
    # Records hold the one empty map whenever a map is empty (frozen_map), so identity
    # answers what len() would, without a call into pyrsistent's Python code.
    if (
        single.multi_modal_data is _EMPTY
        and single.multi_modal_uuids is _EMPTY
        and (policy is None or policy == _DEFAULT_POLICY)
    ):
        return prompt  # no key to scope; a policy given is kept, though, for media added later
    current = single.scope
    if policy is None:
        policy = _DEFAULT_POLICY if current is None else current.policy
    elif current is not None and current.policy is not policy:
        _check_policy_kept(current.policy, policy)
    if policy.bind_content:
        check_bindable(single._view)
    scope = _SCOPES.get((stage_id, replica_id, id(hasher), id(policy)))
    if scope is None or scope.hasher is not hasher or scope.policy is not policy:
        scope = _new_scope(stage_id, replica_id, hasher, policy)
    if current is scope or (current is not None and current == scope):
        return prompt
    result: _P = with_scope(prompt, scope)
    return result


def unscoped(prompt: _P) -> _P:
    """``prompt`` without its scope (both parts of a pair): its keys as the caller gave
    them, its policy gone with the scope. For the roads that scope nothing; never to hand
    a tenant's record on unscoped where it is scoped again."""
    if isinstance(prompt, EncoderDecoderPrompt):
        encoder, decoder = prompt.encoder_prompt, prompt.decoder_prompt
        parts = [None if part is None else unscoped(part) for part in (encoder, decoder)]
        if parts[0] is encoder and parts[1] is decoder:
            return prompt
        pair: _P = replace_fields(prompt, encoder_prompt=parts[0], decoder_prompt=parts[1])
        return pair
    single: SinglePrompt = prompt
    if single.scope is None:
        return prompt
    with_scope = _WITH_SCOPE.get(type(prompt)) or field_copier(type(prompt), ("scope",))
    result: _P = with_scope(prompt, None)
    return result


def _check_policy_kept(current: KeyPolicy, policy: KeyPolicy) -> None:
    """A policy set on a record stays with it: scoping may add one, never change or drop it."""
    if current != policy and current != _DEFAULT_POLICY:
        raise InvalidPromptError(
            "policy",
            f"the prompt is already scoped under {current!r}, and a record keeps its policy "
            f"through every scoping; got {policy!r} (pass policy=None to keep it)",
        )


def _scope_pair(
    prompt: _P, replica_id: int, hasher: MediaHasher, stage_id: int, policy: KeyPolicy | None
) -> _P:
    """scope_to_replica for an encoder-decoder pair: both prompts, in the same scope."""
    if not isinstance(prompt, EncoderDecoderPrompt):
        raise PromptTypeError("prompt", f"must be a prompt record, got {type_name(prompt)}")
    if policy is None:  # the pair is scoped together: a policy either part carries binds both
        kept = {p.scope.policy for p in (prompt.encoder_prompt, prompt.decoder_prompt) if p and p.scope}
        kept.discard(_DEFAULT_POLICY)
        if len(kept) > 1:
            raise InvalidPromptError(
                "policy", f"the encoder and decoder prompts are scoped under different policies: {kept}"
            )
        policy = kept.pop() if kept else None
    parts = []
    named = (("$.encoder_prompt", prompt.encoder_prompt), ("$.decoder_prompt", prompt.decoder_prompt))
    for name, part in named:
        try:
            parts.append(
                None
                if part is None
                else scope_to_replica(part, replica_id, hasher=hasher, stage_id=stage_id, policy=policy)
            )
        except OmniRequestsError as error:  # named in the pair
            raise error.under(name) from None
    encoder, decoder = parts
    if encoder is prompt.encoder_prompt and decoder is prompt.decoder_prompt:
        return prompt
    scoped: _P = replace_fields(prompt, encoder_prompt=encoder, decoder_prompt=decoder)
    return scoped


class _RequestDigests:
    """The content keys one request has computed, for that same request's later walks.

    Keyed by the item object (held here, so its id cannot be reused while the request
    runs) and its modality. Closed when the request ends: a context copied during the
    request (an asyncio task it started) finds nothing afterwards, and hashes again.
    """

    __slots__ = ("_keys", "hasher", "open")

    def __init__(self, hasher: MediaHasher) -> None:
        self.hasher = hasher
        self.open = True
        self._keys: dict[tuple[str, int], tuple[object, str]] = {}

    def content_key(self, modality: str, item: object) -> str:
        found = self._keys.get((modality, id(item)))
        if found is not None and found[0] is item and self.open:
            return found[1]
        digest = self.hasher._content_key(modality, item)
        if self.open:
            self._keys[(modality, id(item))] = (item, digest)
        return digest

    def close(self) -> None:
        self.open = False
        self._keys.clear()


_REQUEST: Final[ContextVar[_RequestDigests | None]] = ContextVar("omni_requests.request", default=None)


def one_request(hasher: MediaHasher) -> _OneRequest:
    """Within the block, each media item's content key under ``hasher`` is computed once.

    For an engine's request path that reads a request's keys more than once (to route it,
    then to render its scoped prompts): every walk of :func:`media_keys` and
    :func:`rendered_uuids` in the block takes the key of an item (the same object, under
    the same modality) that an earlier walk computed, instead of hashing it again. That is
    what makes a PIL image or a tensor, whose keys are never cached (nothing stops writes
    to them), cost one hash per request. The keys are exactly the ones the walks would
    compute: only *when* the item is hashed changes, never how.

    The reuse lasts for the block and this context only: a later request (or the same
    prompt rendered after the block) hashes again, so a change to an image between
    requests is always seen. Within the block, the item must not change: keep the block
    to one request, from its first key to the dicts handed to the engine (a change after
    that is one "while the engine is reading", outside the contract of ``docs/security.md``).
    """
    return _OneRequest(hasher)


class _OneRequest:
    # A class, not a generator-based context manager: it is entered on every routed
    # request, and costs a third as much. Entered once, as a generator's would be: a
    # second entry (nested, or from another thread) would share the request's digests
    # and lose the first entry's token.
    __slots__ = ("_reuse", "_token")

    def __init__(self, hasher: MediaHasher) -> None:
        self._reuse = _RequestDigests(hasher)
        self._token: Token[_RequestDigests | None] | None = None

    def __enter__(self) -> None:
        if self._token is not None or not self._reuse.open:
            raise RuntimeError("a one_request block is entered once: call one_request() for each block")
        self._token = _REQUEST.set(self._reuse)

    def __exit__(self, *_: object) -> None:
        self._reuse.close()
        _REQUEST.reset(self._token)  # type: ignore[arg-type]  # set by __enter__


_K = TypeVar("_K")


def _keyed(key_of: Callable[[str, Any], str], modality: str, index: int, item: object) -> str:
    """``key_of(modality, item)``, where an item vLLM's parser would refuse too (an image
    whose transparency Pillow cannot apply, say) raises our error, naming the item.
    What is not the item's (see ``confirm_fault``) is raised as it is."""
    try:
        return key_of(modality, item)
    except (OmniRequestsError, *NOT_THE_INPUTS):
        raise
    except Exception as error:  # whatever Pillow, numpy or torch raise on it
        confirm_fault(error, lambda: key_of(modality, item))
        raise InvalidPromptError(
            f"$.multi_modal_data.{modality}[{index}]",
            f"cannot be keyed ({type(error).__name__}: {error})",
        ) from error


def _derive(
    prompt: SinglePrompt,
    hasher: MediaHasher | None,
    bind: bool,
    user: Callable[[str, str | None], _K],
    content: Callable[[str], _K],
) -> tuple[dict[str, list[_K | None]], bool]:
    """How every key is derived, the one walk :func:`media_keys` and :func:`rendered_uuids` share.

    An item with a user UUID gets ``user(uuid, fingerprint)`` (the fingerprint only when
    ``bind``), one without gets ``content(hasher's content key)``, a cached-only item
    without a UUID None; UUIDs of a modality with no data (cached-only items, as vLLM
    allows) are user keys too. Returns the keys per modality, in the record's order, and
    whether they are fixed: every item read for them (hashed, or fingerprinted for a
    binding) is frozen, a record's own array or sealed image or tensor, so the same scope
    renders the same keys for as long as the record holds these items.
    """
    if bind:
        check_bindable(prompt._view)
    keys: dict[str, list[_K | None]] = {}
    fixed = True
    # Inside one_request: its keys for this hasher (an equal one computes the same keys).
    reuse = _REQUEST.get()
    if reuse is not None and reuse.hasher is not hasher and reuse.hasher != hasher:
        reuse = None
    # Items with a user UUID, and items keyed by their content digest: a UUID equal to a
    # digest is one cache entry for both, unscoped or under the default policy. Compared
    # bare whatever the scope's policy (one that renders them apart is refused too): the
    # bases are remembered with the media, across a template's scopes.
    named: dict[str, tuple[str, int, object]] = {}
    hashed: dict[str, tuple[str, int]] = {}
    for modality, items, given in prompt._view:
        if items is None:  # cached-only items (binding refused them above)
            keys[modality] = [None if u is None else user(u, None) for u in given]  # type: ignore[union-attr]
            continue
        row: list[_K | None] = []
        for i, item in enumerate(items):
            uuid = None if given is None else given[i]
            if uuid is not None:
                fingerprint = None
                if bind:
                    fingerprint = _keyed(hasher._record_fingerprint, modality, i, item)  # type: ignore[union-attr]
                    fixed = fixed and is_frozen_item(item)
                row.append(user(uuid, fingerprint))
                if item is not None:
                    named[uuid] = (modality, i, item)
            elif item is None:
                row.append(None)
            elif hasher is None:
                raise PromptTypeError(
                    "hasher", "an unscoped prompt needs a MediaHasher to derive content keys"
                )
            else:
                # An item that can change (a tensor or image kept unsealed) is hashed at
                # every render (once per request in one_request): only then is a change seen.
                fixed = fixed and is_frozen_item(item)
                key_of = hasher._content_key if reuse is None else reuse.content_key
                digest = _keyed(key_of, modality, i, item)
                hashed[digest] = (modality, i)
                row.append(content(digest))
        keys[modality] = row
    if hashed and named:
        _refuse_uuid_as_content_key(named, hashed, key_of)
    return keys, fixed


def _refuse_uuid_as_content_key(
    named: dict[str, tuple[str, int, object]],
    hashed: dict[str, tuple[str, int]],
    key_of: Callable[[str, Any], str],
) -> None:
    """Refuses a user UUID that is the content key of another item of the prompt, which
    is other media: the engine would hold both under one cache entry."""
    for uuid in named.keys() & hashed.keys():
        modality, i, item = named[uuid]
        if _keyed(key_of, modality, i, item) == uuid:
            continue  # the UUID is this item's own content key: one media, one entry
        other, j = hashed[uuid]
        raise InvalidPromptError(
            f"$.multi_modal_uuids.{modality}[{i}]",
            f"UUID {uuid!r} is the content key of multi_modal_data[{other!r}][{j}], which is other "
            "media; the engine keys that item by its content, so one of the two would be served "
            "the other's features. Give this item another UUID",
        )


def media_keys(
    prompt: SinglePrompt, hasher: MediaHasher | None = None
) -> PMap[str, PVector[MediaKey | None]]:
    """Every media item's key, per modality, in item order.

    The hasher defaults to the one the prompt was scoped with; an unscoped prompt needs
    one for items without a user UUID. ``None`` stands for an item that is ``None``
    (cached only) without a UUID.

    Where every item read is frozen the keys are remembered with the media, per hasher
    and scope, as :func:`rendered_uuids` remembers rendered keys.
    """
    _check_single(prompt)
    if hasher is not None and not isinstance(hasher, MediaHasher):
        raise PromptTypeError("hasher", f"must be a MediaHasher or None, got {type_name(hasher)}")
    scope = prompt.scope
    if hasher is None and scope is not None:
        hasher = scope.hasher
    memo_key = (_KEYS, id(hasher), id(scope))
    known = prompt._memo.get(memo_key)
    if known is not None and known[0] is hasher and known[1] is scope:
        return known[2]  # type: ignore[no-any-return]

    def user(uuid: str, binding: str | None) -> MediaKey:
        return MediaKey(uuid, KeyOrigin.USER, scope, binding)

    def content(digest: str) -> MediaKey:
        return MediaKey(digest, KeyOrigin.CONTENT, scope)

    bind = scope is not None and scope.policy.bind_content
    keys, fixed = _derive(prompt, hasher, bind, user, content)
    found = pmap({m: pvector(row) for m, row in keys.items()})
    if fixed:
        _remember(prompt, memo_key, (hasher, scope, found))
    return found


_KEYS: Final = "omni_requests.media_keys"


def _remember(prompt: SinglePrompt, memo_key: object, value: object) -> None:
    """Keeps ``value`` in ``prompt``'s memo, which a template shares with its scoped copies
    (bounded: cleared when full)."""
    memo = prompt._memo
    if len(memo) >= _MAX_MEMO:
        memo.clear()
    memo[memo_key] = value


def key_bases(prompt: SinglePrompt, hasher: MediaHasher) -> tuple[str, ...]:
    """The bases of ``prompt``'s media keys under ``hasher``, modalities in name order
    (stable across processes), items in order, ``None`` items left out: what a routing
    policy reads.

    Exactly the bases of ``media_keys(prompt, hasher)``, with its checks and errors
    (bindings included, where the prompt's scope binds). Where every item read is frozen
    they are remembered with the media, per hasher, as :func:`rendered_uuids` remembers
    rendered keys: a template's scoped copies route without a walk.
    """
    _check_single(prompt)
    scope = prompt.scope
    bind = scope is not None and scope.policy.bind_content
    memo_key = (_BASES, id(hasher), bind)
    known = prompt._memo.get(memo_key)
    if known is not None and known[0] is hasher:
        return known[1]  # type: ignore[no-any-return]
    keys, fixed = _derive(prompt, hasher, bind, _user_base, _as_base)
    bases = tuple(base for modality in sorted(keys) for base in keys[modality] if base is not None)
    if fixed:
        _remember(prompt, memo_key, (hasher, bases))
    return bases


_BASES: Final = "omni_requests.bases"


def _user_base(uuid: str, _binding: str | None) -> str:
    return uuid


def _as_base(digest: str) -> str:
    return digest


_SINGLE_KINDS: Final = frozenset(SINGLE_KINDS)


def _check_single(prompt: object) -> None:
    if not isinstance(prompt, SINGLE_KINDS):
        pair = isinstance(prompt, EncoderDecoderPrompt)
        advice = " (render each part of a pair: to_vllm does)" if pair else ""
        raise PromptTypeError("prompt", f"must be a single prompt record, got {type_name(prompt)}{advice}")


def rendered_uuids(prompt: SinglePrompt) -> dict[str, list[str | None]] | None:
    """The ``multi_modal_uuids`` the engine gets for ``prompt``, or None for none at all.

    Unscoped: the caller's UUIDs as given (vLLM hashes the rest itself). Scoped: every
    item's key rendered with its scope. Keys that read no item its holder can change
    (user UUIDs, a record's own arrays, its sealed images and tensors) are rendered once
    per template and scope and remembered with the media; others at every call.
    """
    if type(prompt) not in _SINGLE_KINDS:  # on every request's path: one set lookup
        _check_single(prompt)
    scope = prompt.scope
    if scope is None:
        callers = plain_map(prompt.multi_modal_uuids)
        return {m: list(u) for m, u in callers.items()} if callers else None
    if not prompt._view:
        return None
    # Fixed keys depend only on the media a template shares with its scoped copies, and on
    # the scope: they are rendered once per template and scope. A copy with other media
    # starts a fresh memo (field_copier), so no key outlives the items it was derived from.
    known = prompt._memo.get(id(scope))
    if known is not None and known[0] is scope:
        fresh = {}
        for modality, keys in known[1]:  # a loop, not a comprehension: no frame of its own (3.11)
            fresh[modality] = list(keys)
        return fresh
    text = key_text(scope)
    rendered, fixed = _derive(prompt, scope.hasher, text.binds, text.user_key, text.content_key)
    if fixed:
        frozen = []
        for modality, keys in rendered.items():  # a loop, not a generator: no frame of its own
            frozen.append((modality, tuple(keys)))
        _remember(prompt, id(scope), (scope, tuple(frozen)))
    return rendered
