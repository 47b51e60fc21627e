"""Values kept by an object's identity, for as long as that object lives.

Records keep facts about objects they made or checked (a map's plain view, a list's
modality, an image's seal) without holding the objects themselves and without asking
them to be hashable: by ``id``, with a weak reference that drops the entry when the
object dies, before its memory (and so its ``id``) can be reused.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

__all__: list[str] = []

_V = TypeVar("_V")


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weak reference that knows its entry's key: one shared callback, no closure each."""

    __slots__ = ("key",)
    key: int


class IdentityMap(Generic[_V]):
    """``object -> value`` by the object's identity; an entry leaves with its object."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[_Ref, _V]] = {}

    def get(self, obj: object) -> _V | None:
        """The value put for ``obj`` (this very object, alive), or None."""
        entry = self._entries.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return None

    def put(self, obj: object, value: _V) -> None:
        """Keep ``value`` for ``obj``, in place of any value put for it before."""
        ref = _Ref(obj, self._drop)
        ref.key = id(obj)
        self._entries[ref.key] = (ref, value)

    def _drop(self, ref: _Ref) -> None:
        entry = self._entries.get(ref.key)
        if entry is not None and entry[0] is ref:
            del self._entries[ref.key]

    def __len__(self) -> int:
        return len(self._entries)
