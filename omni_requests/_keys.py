"""Media keys: a base (user UUID or content hash) and an optional replica scope, kept apart.

The engine-facing string ``stage{S}:rep{R}:{base}`` is rendered only at the boundary,
so replacing a scope can never stack prefixes.
"""

from __future__ import annotations

import enum
import re
from typing import Final

import attrs

from ._errors import InvalidPromptError, PromptTypeError, type_name
from ._hashing import MediaHasher

__all__ = ["KeyOrigin", "MediaKey", "Scope", "looks_scoped"]

# What vllm-omni writes in front of a key; a user UUID shaped like this has been through
# an engine already and would become a double prefix.
_SCOPED: Final = re.compile(r"stage\d+:rep\d+:")


def looks_scoped(value: str) -> bool:
    """True when ``value`` starts like an engine-scoped key (``stage0:rep1:...``)."""
    return _SCOPED.match(value) is not None


def check_index(path: str, value: object) -> int:
    """A non-negative ``int`` (not a ``bool``), or a clear error naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PromptTypeError(path, f"must be an int, got {type_name(value)}")
    if value < 0:
        raise InvalidPromptError(path, f"must be >= 0, got {value}")
    return value


def _index(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    check_index(f"$.{attribute.name}", value)


def _hasher(_: object, attribute: attrs.Attribute[MediaHasher], value: object) -> None:
    if not isinstance(value, MediaHasher):
        raise PromptTypeError(f"$.{attribute.name}", f"must be a MediaHasher, got {type_name(value)}")


@attrs.frozen
class Scope:
    """Where a prompt is routed: a stage, one of its replicas, and the hasher for content keys."""

    stage_id: int = attrs.field(validator=_index)
    replica_id: int = attrs.field(validator=_index)
    hasher: MediaHasher = attrs.field(validator=_hasher)

    @property
    def prefix(self) -> str:
        """The text vllm-omni puts before a base: ``stage{S}:rep{R}:``."""
        return f"stage{self.stage_id}:rep{self.replica_id}:"


class KeyOrigin(enum.Enum):
    """Where a key's base came from."""

    USER = "user"
    """The caller's ``multi_modal_uuids`` entry."""
    CONTENT = "content"
    """The hash of the item's content."""


@attrs.frozen
class MediaKey:
    """A media item's cache key: its base, where the base came from, and its scope."""

    base: str
    origin: KeyOrigin
    scope: Scope | None = None

    def render(self) -> str:
        """The string the engine sees: ``stage{S}:rep{R}:{base}``, or the bare base."""
        return self.base if self.scope is None else self.scope.prefix + self.base

    def __str__(self) -> str:
        return self.render()
