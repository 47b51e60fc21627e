"""Media keys: a base (user UUID or content hash) and an optional replica scope, kept apart.

The engine-facing string ``stage{S}:rep{R}:{base}`` is rendered only at the boundary,
so replacing a scope can never stack prefixes. A scope may carry a :class:`KeyPolicy`,
opt-in protections that change how user UUIDs render; the default renders as above.
"""

from __future__ import annotations

import enum
import re
from typing import Final

import attrs

from ._errors import InvalidPromptError, PromptTypeError, type_name
from ._frozen import refuse_second_init
from ._hashing import MediaHasher

__all__ = ["KeyOrigin", "KeyPolicy", "MediaKey", "Scope", "looks_scoped", "reserved_prefix"]

# What vllm-omni writes in front of a key; a user UUID shaped like this has been through
# an engine already and would become a double prefix.
_SCOPED: Final = re.compile(r"stage[0-9]+:rep[0-9]+:")  # ASCII digits: engines write ints
# What policies write between the scope and a user UUID or content hash: a user UUID that
# began like this could spell another policy's key (another tenant's, a namespaced one).
_RESERVED: Final = ("tenant:", "user:", "bound:")
# Stage and replica ids are rendered in decimal into every key; far below int's limits.
MAX_INDEX: Final = (1 << 63) - 1
# Tenant names go into keys verbatim, between colons, so they may not contain one.
_TENANT: Final = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def looks_scoped(value: str) -> bool:
    """True when ``value`` starts like an engine-scoped key (``stage0:rep1:...``)."""
    return _SCOPED.match(value) is not None


def reserved_prefix(value: str) -> str | None:
    """The policy prefix ``value`` starts with (``tenant:``, ``user:``, ``bound:``), or None."""
    return next((prefix for prefix in _RESERVED if value.startswith(prefix)), None)


def check_index(path: str, value: object) -> int:
    """A non-negative ``int`` (not a ``bool``), or a clear error naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PromptTypeError(path, f"must be an int, got {type_name(value)}")
    if not 0 <= value <= MAX_INDEX:
        shown = value if value.bit_length() <= 64 else f"an int of {value.bit_length()} bits"
        raise InvalidPromptError(path, f"must be between 0 and 2**63 - 1, got {shown}")
    return int.__int__(value)  # an int subclass renders its own way: keep the plain value


def _stage_index(value: object) -> int:
    return check_index("$.stage_id", value)


def _replica_index(value: object) -> int:
    return check_index("$.replica_id", value)


def _hasher(_: object, attribute: attrs.Attribute[MediaHasher], value: object) -> None:
    if not isinstance(value, MediaHasher):
        raise PromptTypeError(f"$.{attribute.name}", f"must be a MediaHasher, got {type_name(value)}")


def _flag(_: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise PromptTypeError(f"$.{attribute.name}", f"must be a bool, got {type_name(value)}")


def _tenant(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise PromptTypeError("$.tenant", f"must be a str or None, got {type_name(value)}")
    value = str.__str__(value)  # a subclass could render itself as another tenant
    if _TENANT.fullmatch(value) is None:
        raise InvalidPromptError(
            "$.tenant",
            f"{value!r} is not a tenant name: use 1 to 128 of A-Z a-z 0-9 . _ ~ - "
            "(hash or slug other identifiers first)",
        )
    return value


class KeyOrigin(enum.Enum):
    """Where a key's base came from."""

    USER = "user"
    """The caller's ``multi_modal_uuids`` entry."""
    CONTENT = "content"
    """The hash of the item's content."""


@attrs.frozen(cache_hash=True, getstate_setstate=False)
class KeyPolicy:
    """Opt-in protections for user-supplied UUIDs, applied where keys are rendered.

    The default policy renders keys exactly as vllm-omni does, ``stage{S}:rep{R}:{base}``.
    Each flag adds one guarantee, at the cost of keys the engine's own hashing would not
    produce; see ``docs/security.md`` for the trade-offs. A scoped user key renders as
    ``stage{S}:rep{R}:[tenant:{T}:][user:][bound:{fingerprint}:]{uuid}``, a content key
    as ``stage{S}:rep{R}:[tenant:{T}:]{hash}`` (the tenant part only with ``tenant_content``).

    >>> import numpy as np
    >>> from omni_requests import MediaHasher, TextPrompt, rendered_uuids, scope_to_replica
    >>> p = TextPrompt(prompt="<image>", multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
    ...                multi_modal_uuids={"image": "cat-1"})
    >>> policy = KeyPolicy(namespaces=True, tenant="acme")
    >>> rendered_uuids(scope_to_replica(p, 1, hasher=MediaHasher("m"), policy=policy))
    {'image': ['stage0:rep1:tenant:acme:user:cat-1']}
    """

    namespaces: bool = attrs.field(default=False, validator=_flag)
    """Render user UUIDs under ``user:``, so none can equal a content hash (bare hex)."""
    tenant: str | None = attrs.field(default=None, converter=_tenant)
    """Render user UUIDs under ``tenant:{tenant}:``, so tenants never share a UUID's key."""
    tenant_content: bool = attrs.field(default=False, validator=_flag)
    """Put content keys under the tenant too: no cross-tenant cache hits, at the cost of
    one cached copy per tenant. Needs ``tenant``."""
    bind_content: bool = attrs.field(default=False, validator=_flag)
    """Bind user UUIDs to a cheap fingerprint of their item (:meth:`MediaHasher.fingerprint`),
    so a UUID reused for other media gets another key. Items must be sent, not cached-only."""

    def __attrs_pre_init__(self) -> None:
        refuse_second_init(self, "namespaces")  # shared by every scope and record using it

    def __attrs_post_init__(self) -> None:
        if self.tenant_content and self.tenant is None:
            raise InvalidPromptError("$.tenant_content", "needs a tenant")

    def __reduce__(self) -> tuple[type[KeyPolicy], tuple[bool, str | None, bool, bool]]:
        # Through the constructor, positionally: checked again, and fields added later
        # with defaults still load old pickles.
        return (type(self), (self.namespaces, self.tenant, self.tenant_content, self.bind_content))

    @property
    def user_part(self) -> str:
        """What goes between the scope prefix and a user UUID (before any binding)."""
        tenant = "" if self.tenant is None else f"tenant:{self.tenant}:"
        return tenant + ("user:" if self.namespaces else "")

    @property
    def content_part(self) -> str:
        """What goes between the scope prefix and a content hash."""
        return f"tenant:{self.tenant}:" if self.tenant_content else ""

    def render_base(self, base: str, origin: KeyOrigin, binding: str | None = None) -> str:
        """The part of a key after the scope prefix, for a base of this origin.

        ``binding`` is the item's fingerprint, needed for user UUIDs when the policy
        binds them to their content.
        """
        return KeyText("", self).render(base, origin, binding)


_DEFAULT_POLICY: Final = KeyPolicy()


def _policy(_: object, attribute: attrs.Attribute[KeyPolicy], value: object) -> None:
    if type(value) is not KeyPolicy:  # a subclass could redefine ==, which keeps policies
        raise PromptTypeError(f"$.{attribute.name}", f"must be a KeyPolicy, got {type_name(value)}")


@attrs.frozen(getstate_setstate=False)
class Scope:
    """Where a prompt is routed: a stage, one of its replicas, the hasher for content keys,
    and the :class:`KeyPolicy` keys render with (the default renders as vllm-omni does)."""

    stage_id: int = attrs.field(converter=_stage_index)
    replica_id: int = attrs.field(converter=_replica_index)
    hasher: MediaHasher = attrs.field(validator=_hasher)
    policy: KeyPolicy = attrs.field(default=_DEFAULT_POLICY, validator=_policy)

    def __attrs_pre_init__(self) -> None:
        refuse_second_init(self, "stage_id")

    @property
    def prefix(self) -> str:
        """The text vllm-omni puts before a base: ``stage{S}:rep{R}:``."""
        return f"stage{self.stage_id}:rep{self.replica_id}:"

    def __reduce__(self) -> tuple[type[Scope], tuple[int, int, MediaHasher, KeyPolicy]]:
        # Through the constructor, like KeyPolicy's.
        return (type(self), (self.stage_id, self.replica_id, self.hasher, self.policy))


class KeyText:
    """How keys are written under one prefix and policy: the one place a key's text is made.

    ``user`` goes before a user UUID and ``content`` before a content hash; a policy that
    binds UUIDs writes ``{user}bound:{fingerprint}:{uuid}``. :meth:`MediaKey.render`,
    :meth:`KeyPolicy.render_base` and :func:`~omni_requests.rendered_uuids` all write
    keys through this class (one per scope, see :func:`key_text`).
    """

    __slots__ = ("binds", "content", "user")

    def __init__(self, prefix: str, policy: KeyPolicy) -> None:
        self.user = prefix + policy.user_part
        self.content = prefix + policy.content_part
        self.binds = policy.bind_content

    def user_key(self, uuid: str, binding: str | None) -> str:
        """A user UUID's key; ``binding`` is its item's fingerprint when :attr:`binds`."""
        if not self.binds:
            return self.user + uuid
        if binding is None:
            raise InvalidPromptError(
                "binding", "this policy binds user UUIDs to their content, but the key has no fingerprint"
            )
        return f"{self.user}bound:{binding}:{uuid}"

    def content_key(self, digest: str) -> str:
        """A content hash's key."""
        return self.content + digest

    def render(self, base: str, origin: KeyOrigin, binding: str | None = None) -> str:
        """The key of a base of this origin."""
        return self.content + base if origin is KeyOrigin.CONTENT else self.user_key(base, binding)


# KeyText per scope, by identity (the entry holds its scope, so the id stays its own).
# Bounded: a deployment has a handful of stages, replicas and policies.
_TEXTS: dict[int, tuple[Scope, KeyText]] = {}
_MAX_TEXTS: Final = 4096


def key_text(scope: Scope) -> KeyText:
    """The :class:`KeyText` of ``scope``'s prefix and policy, built once per scope."""
    entry = _TEXTS.get(id(scope))
    if entry is not None and entry[0] is scope:
        return entry[1]
    text = KeyText(scope.prefix, scope.policy)
    if len(_TEXTS) >= _MAX_TEXTS:
        _TEXTS.clear()
    _TEXTS[id(scope)] = (scope, text)
    return text


@attrs.frozen(getstate_setstate=False)
class MediaKey:
    """A media item's cache key: its base, where the base came from, and its scope.

    ``binding`` is the item's fingerprint when the scope's policy binds user UUIDs to
    their content (:attr:`KeyPolicy.bind_content`), else None.
    """

    base: str
    origin: KeyOrigin
    scope: Scope | None = None
    binding: str | None = None

    def __attrs_pre_init__(self) -> None:
        refuse_second_init(self, "base")

    def __reduce__(self) -> tuple[type[MediaKey], tuple[str, KeyOrigin, Scope | None, str | None]]:
        return (type(self), (self.base, self.origin, self.scope, self.binding))  # like Scope's

    def render(self) -> str:
        """The string the engine sees: ``stage{S}:rep{R}:{base}``, or the bare base.

        A scope's non-default :class:`KeyPolicy` adds its parts between the prefix and
        the base.
        """
        scope = self.scope
        if scope is None:
            return self.base
        return key_text(scope).render(self.base, self.origin, self.binding)

    def __str__(self) -> str:
        return self.render()
