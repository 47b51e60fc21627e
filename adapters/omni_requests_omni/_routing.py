"""Choosing a stage-0 replica: what a policy sees, round robin, and cache affinity.

A policy is any callable ``(RouteRequest) -> int | None``: it gets the request's id,
the live replica ids and (lazily) the request's media keys, and returns one of the live
ids, or ``None`` when no replica can take the request now.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Final, TypeAlias

__all__ = ["CacheAffinity", "RoundRobin", "RouteRequest", "SelectReplica"]


class RouteRequest:
    """What a replica-selection policy knows about one request.

    ``media_keys`` are the *unscoped* bases of the request's media keys (the user's UUID
    or the content hash), in order of first appearance, without repeats. They are
    computed on first access only, so a policy that ignores them costs no hashing.
    """

    __slots__ = ("_compute_keys", "_media_keys", "replicas", "request_id")

    request_id: str | None
    replicas: tuple[int, ...]

    def __init__(
        self,
        request_id: str | None,
        replicas: Sequence[int],
        media_keys: Sequence[str] | Callable[[], Sequence[str]] = (),
    ) -> None:
        self.request_id = request_id
        self.replicas = tuple(replicas)
        self._media_keys: tuple[str, ...] | None = None
        self._compute_keys: Callable[[], Sequence[str]] | None = None
        if callable(media_keys):
            self._compute_keys = media_keys
        else:
            self._media_keys = _distinct_keys(media_keys)

    @property
    def media_keys(self) -> tuple[str, ...]:
        if self._media_keys is None:
            assert self._compute_keys is not None
            self._media_keys = _distinct_keys(self._compute_keys())
        return self._media_keys

    def __repr__(self) -> str:
        keys = "<not computed>" if self._media_keys is None else repr(self._media_keys)
        return f"RouteRequest(request_id={self.request_id!r}, replicas={self.replicas!r}, media_keys={keys})"


def _distinct_keys(keys: object) -> tuple[str, ...]:
    """``keys`` in order, without repeats; a str alone is refused (it would read as its characters)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"media_keys must be a sequence of str, not {type(keys).__name__}")
    given = tuple(keys)
    for key in given:
        if not isinstance(key, str):
            raise TypeError(f"media_keys must hold str, not {type(key).__name__}")
    return tuple(dict.fromkeys(given))


SelectReplica: TypeAlias = Callable[[RouteRequest], "int | None"]
"""A replica-selection policy: a live replica id for the request, or ``None`` for none now."""


class RoundRobin:
    """Each request goes to the next live replica in turn; ``None`` when none is live.

    The counter advances once per request, and membership changes take effect at once
    (the turn is taken modulo the current number of live replicas). Thread-safe:
    ``next`` on an ``itertools.count`` is atomic under the GIL.

    >>> policy = RoundRobin()
    >>> picks = [policy(RouteRequest(None, [0, 1, 2])) for _ in range(4)]
    >>> picks
    [0, 1, 2, 0]
    """

    def __init__(self) -> None:
        self._turn = itertools.count()

    def __call__(self, request: RouteRequest) -> int | None:
        replicas = request.replicas
        if not replicas:
            return None
        return replicas[next(self._turn) % len(replicas)]

    def __repr__(self) -> str:
        return "RoundRobin()"


_SCORE_BYTES: Final = 8


def live_replica_id(chosen: object, live: Sequence[int]) -> int | None:
    """A routing policy's ``chosen`` as the plain id of one of the ``live`` replicas, or
    None where it names none: the one test every road applies. An int (an ``IntEnum``
    too, read as the int it holds, whose own ``==`` could lie); never a bool, though
    True == 1, nor a numpy number or float equal to an id (``np.argmin`` gives one)."""
    if isinstance(chosen, bool) or not isinstance(chosen, int):
        return None
    plain = int.__int__(chosen)
    return plain if plain in live else None


# Remembered: a deployment routes the same few keys (a template's media) over the same
# replicas again and again, and a hit costs a fraction of a digest. Only a plain str of
# at most a content key's size or so and a plain int: no caller's long UUID is kept alive,
# and no value that equals another (1.0, True) but reads as other text shares its entry.
_SCORES: Final[dict[tuple[str, int], int]] = {}
_MAX_SCORES: Final = 8192
_MAX_REMEMBERED_KEY: Final = 256


def _score(key: str, replica: int) -> int:
    """A replica's rendezvous weight for ``key``: stable across processes and runs."""
    if type(key) is not str or type(replica) is not int or len(key) > _MAX_REMEMBERED_KEY:
        return _weight(key, replica)
    found = _SCORES.get((key, replica))
    if found is None:
        if len(_SCORES) >= _MAX_SCORES:
            _SCORES.clear()
        found = _SCORES[(key, replica)] = _weight(key, replica)
    return found


def _weight(key: str, replica: int) -> int:
    # surrogatepass: any str routes (a key with a lone surrogate is refused elsewhere, by name).
    data = f"{replica}\x00{key}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(data, digest_size=_SCORE_BYTES).digest()
    return int.from_bytes(digest, "big")


def home(key: str, replicas: Sequence[int]) -> int:
    """The replica of ``replicas`` most preferred for ``key`` (highest random weight; the
    first such in ``replicas`` on a tie)."""
    return max(replicas, key=functools.partial(_score, key))


def _load_of(load: Callable[[int], float], replica: int) -> float:
    value = load(replica)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"load({replica}) must return a number, got {type(value).__name__}") from None


class CacheAffinity:
    """Send requests with the same media to the same replica, whose cache holds it.

    Each media key has a home among the live replicas: the one with the highest
    rendezvous weight for it. A request goes to the replica that is home to most of its
    keys (ties go to the home of its first key). When a replica leaves, only the keys
    homed on it move, each to its next preferred live replica; every other key keeps
    its home, and so its cache entries. A request without media keys goes to
    ``fallback`` (round robin by default).

    Popular media make their home busy. Give ``load`` (a replica's current load, such as
    its queue length) to bound that: a replica whose load has reached
    ``ceil(max_load_ratio * mean load)`` (the mean counting this request) is skipped for
    the next preferred one ("consistent hashing with bounded loads", Mirrokni et al.),
    trading a few cache hits for balance. A load of ``math.inf`` (a replica draining)
    counts in no mean and is skipped while any other replica is under capacity.

    >>> policy = CacheAffinity()
    >>> a = policy(RouteRequest("r1", [0, 1, 2, 3], ["cat-video"]))
    >>> a == policy(RouteRequest("r2", [0, 1, 2, 3], ["cat-video"]))
    True
    """

    def __init__(
        self,
        fallback: SelectReplica | None = None,
        *,
        load: Callable[[int], float] | None = None,
        max_load_ratio: float = 1.25,
    ) -> None:
        if isinstance(max_load_ratio, bool) or not isinstance(max_load_ratio, (int, float)):
            raise TypeError(f"max_load_ratio must be a number, got {type(max_load_ratio).__name__}")
        if not math.isfinite(max_load_ratio) or max_load_ratio < 1.0:  # NaN passed `< 1.0`
            raise ValueError(f"max_load_ratio must be finite and >= 1.0, got {max_load_ratio!r}")
        for name, value in (("fallback", fallback), ("load", load)):
            if value is not None and not callable(value):  # else it fails at the first request
                raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
        self.fallback: SelectReplica = fallback if fallback is not None else RoundRobin()
        self.load = load
        self.max_load_ratio = max_load_ratio

    def preference(self, request: RouteRequest) -> list[int]:
        """The live replicas in the order this policy prefers them for ``request``."""
        keys = request.media_keys
        replicas = request.replicas
        if not keys or not replicas:
            return []
        votes = dict.fromkeys(replicas, 0)
        for key in keys:
            votes[home(key, replicas)] += 1
        first = keys[0]
        return sorted(replicas, key=lambda replica: (votes[replica], _score(first, replica)), reverse=True)

    def __call__(self, request: RouteRequest) -> int | None:
        order = self.preference(request)
        if not order:
            return self.fallback(request) if request.replicas else None
        if self.load is None:
            return order[0]
        loads = {replica: _load_of(self.load, replica) for replica in order}
        # A replica of infinite (or NaN) load, one draining say, is never under capacity
        # and counts in no mean. Capacity per replica once this request is counted:
        # ceil(c * (total + 1) / n), over the others.
        finite = [load for load in loads.values() if math.isfinite(load)]
        capacity = self.max_load_ratio * (sum(finite) + 1.0) / max(len(finite), 1)
        if math.isfinite(capacity):  # loads near float's limit sum past it
            capacity = math.ceil(capacity)
        for replica in order:
            if loads[replica] < capacity:
                return replica
        # Only for odd loads (negative, infinite, NaN): the least loaded, NaN as infinite.
        return min(
            order, key=lambda replica: loads[replica] if loads[replica] == loads[replica] else math.inf
        )

    def __repr__(self) -> str:
        bounded = "" if self.load is None else f", load=..., max_load_ratio={self.max_load_ratio}"
        return f"CacheAffinity(fallback={self.fallback!r}{bounded})"
