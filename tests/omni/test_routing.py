"""Replica-selection policies: round robin, and cache affinity by rendezvous hashing."""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from omni_requests import MediaHasher
from omni_requests_omni import (
    CacheAffinity,
    RoundRobin,
    RouteRequest,
    Stage0Balancer,
    Stage0Pool,
    scope_stage0,
)

from ._helpers import image_array

KEYS = [f"media-{i}" for i in range(2000)]


def _home(policy: CacheAffinity, key: str, replicas: list[int]) -> int | None:
    return policy(RouteRequest(None, replicas, [key]))


def test_round_robin_turns_over_the_live_replicas_and_follows_membership() -> None:
    policy = RoundRobin()
    assert [policy(RouteRequest(None, [0, 1, 2])) for _ in range(4)] == [0, 1, 2, 0]
    assert [policy(RouteRequest(None, [0, 2])) for _ in range(2)] == [0, 2]  # turn 4, 5
    assert policy(RouteRequest(None, [])) is None


def test_cache_affinity_sends_the_same_media_to_the_same_replica_in_any_process() -> None:
    replicas = [0, 1, 2, 3]
    homes = [_home(CacheAffinity(), key, replicas) for key in KEYS[:50]]
    assert homes == [_home(CacheAffinity(), key, replicas) for key in KEYS[:50]]
    # Another interpreter (another hash seed) agrees: no use of Python's hash().
    code = textwrap.dedent(
        """
        from omni_requests_omni import CacheAffinity, RouteRequest
        print([CacheAffinity()(RouteRequest(None, [0, 1, 2, 3], [f"media-{i}"])) for i in range(50)])
        """
    )
    import os

    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == str(homes)


def test_cache_affinity_spreads_distinct_media_evenly() -> None:
    counts = collections.Counter(_home(CacheAffinity(), key, [0, 1, 2, 3]) for key in KEYS)
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) / min(counts.values()) < 1.25  # 500 expected each


def test_when_a_replica_leaves_only_the_media_homed_on_it_move() -> None:
    policy = CacheAffinity()
    before = {key: _home(policy, key, [0, 1, 2, 3]) for key in KEYS}
    after = {key: _home(policy, key, [0, 1, 3]) for key in KEYS}
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == 2}
    assert 2 not in after.values()
    # ... and come back home when it returns.
    assert {key: _home(policy, key, [0, 1, 2, 3]) for key in KEYS} == before


def test_a_request_goes_where_most_of_its_media_live() -> None:
    policy = CacheAffinity()
    replicas = [0, 1, 2, 3]
    by_home: dict[int, list[str]] = collections.defaultdict(list)
    for key in KEYS[:200]:
        by_home[_home(policy, key, replicas)].append(key)  # type: ignore[index]
    lone, *pair = by_home[0][:1] + by_home[3][:2]
    assert policy(RouteRequest(None, replicas, [lone, *pair])) == 3
    # A tie goes to the home of the first key, whichever replica that is (either order:
    # a stable sort of the votes alone would give the lower id both times).
    assert policy(RouteRequest(None, replicas, [by_home[1][0], by_home[2][0]])) == 1
    assert policy(RouteRequest(None, replicas, [by_home[2][0], by_home[1][0]])) == 2


def test_requests_without_media_keys_use_the_fallback() -> None:
    calls: list[RouteRequest] = []

    def fallback(request: RouteRequest) -> int:
        calls.append(request)
        return 7

    policy = CacheAffinity(fallback)
    assert policy(RouteRequest("r", [5, 7], [])) == 7
    assert len(calls) == 1
    assert CacheAffinity()(RouteRequest("r", [], ["k"])) is None


def test_bounded_load_skips_a_busy_home_for_the_next_preferred_replica() -> None:
    load = {0: 0, 1: 0, 2: 0, 3: 0}
    policy = CacheAffinity(load=load.__getitem__, max_load_ratio=1.25)
    request = RouteRequest(None, [0, 1, 2, 3], ["popular"])
    home, second = CacheAffinity().preference(request)[:2]
    assert policy(request) == home
    load[home] = 10
    assert policy(request) == second
    load.update({0: 10, 1: 10, 2: 10, 3: 10})
    assert policy(request) == home  # all equally busy: the home again
    with pytest.raises(ValueError, match=r"max_load_ratio must be finite and >= 1\.0"):
        CacheAffinity(max_load_ratio=0.5)
    # Accepted before, they failed at the first request ("'int' object is not callable").
    for name in ("fallback", "load"):
        with pytest.raises(TypeError, match=f"^{name} must be callable or None, got int"):
            CacheAffinity(**{name: 5})  # type: ignore[arg-type]


def test_bounded_load_takes_a_draining_replica_and_odd_settings_without_a_stray_error() -> None:
    # An infinite load (a replica draining) raised OverflowError from math.ceil in the
    # middle of routing; a NaN ratio passed the check and failed every request; a str
    # ratio or a load of None gave Python's own errors (found by an adversarial review).
    request = RouteRequest(None, [0, 1, 2, 3], ["popular"])
    home, second = CacheAffinity().preference(request)[:2]
    load = dict.fromkeys(range(4), 0.0)
    policy = CacheAffinity(load=load.__getitem__)
    load[home] = math.inf
    assert policy(request) == second  # the draining home is skipped
    load.update(dict.fromkeys(range(4), math.inf))
    assert policy(request) == home  # all draining: the home still
    load.update(dict.fromkeys(range(4), 1e308))
    assert policy(request) == home  # a sum past float's limit
    load.update({home: math.nan})
    assert policy(request) == second
    for ratio in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            CacheAffinity(max_load_ratio=ratio)
    with pytest.raises(TypeError, match="must be a number, got str"):
        CacheAffinity(max_load_ratio="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load\(\d\) must return a number, got NoneType"):
        CacheAffinity(load=lambda replica: None)(request)  # type: ignore[arg-type,return-value]


def test_routing_only_computes_media_keys_when_the_policy_reads_them() -> None:
    computed: list[int] = []

    def keys() -> list[str]:
        computed.append(1)
        return ["b", "a", "b"]

    request = RouteRequest("r", [0, 1], keys)
    assert RoundRobin()(request) in (0, 1)
    assert computed == []
    assert request.media_keys == ("b", "a")  # first appearance, no repeats
    assert request.media_keys == ("b", "a")
    assert computed == [1]


def test_cache_affinity_keeps_a_repeated_image_on_one_replica_through_scope_stage0() -> None:
    hasher = MediaHasher("/models/tiny-omni")
    pool = Stage0Pool(replicas=[0, 1, 2, 3], select=CacheAffinity())
    keys: dict[int, set[Any]] = collections.defaultdict(set)
    for round_ in range(3):
        for seed in range(8):
            prompt = {"prompt": f"<image> {round_}", "multi_modal_data": {"image": image_array(seed)}}
            replica, out = scope_stage0(prompt, pool=pool, hasher=hasher)
            keys[seed].add((replica, out["multi_modal_uuids"]["image"][0]))
    assert all(len(seen) == 1 for seen in keys.values())  # one replica, one key per image
    assert len({replica for seen in keys.values() for replica, _ in seen}) > 1  # and images spread


def test_media_keys_are_a_sequence_of_str_kept_once_each() -> None:
    # A bare str used to be read as its characters: one key "cat-video" became nine.
    for keys in ("cat-video", b"cat", 3):
        with pytest.raises(TypeError, match="media_keys must be a sequence of str"):
            RouteRequest("r", [0, 1], keys)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="media_keys must hold str, not int"):
        RouteRequest("r", [0, 1], ["a", 1])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="media_keys must be a sequence of str"):
        RouteRequest("r", [0, 1], lambda: "cat-video").media_keys  # noqa: B018 - computed on access
    assert RouteRequest("r", [0, 1], ["b", "a", "b"]).media_keys == ("b", "a")
    with pytest.raises(TypeError, match="media_keys must be a sequence of str"):
        Stage0Balancer(CacheAffinity()).select({"request_id": "r", "media_keys": "cat-video"}, [0, 1])


def test_rendezvous_weights_are_remembered_only_for_short_keys_and_plain_ids() -> None:
    # Remembered weights must be the weights: a replica id that equals another (1.0,
    # True) but reads as other text gets its own, in any order, and a long user UUID is
    # weighed each time instead of being kept alive by the cache.
    from omni_requests_omni import _routing

    _routing._SCORES.clear()
    for ids in ([1, 1.0, True], [True, 1.0, 1]):
        assert [_routing._score("cat", r) for r in ids] == [_routing._weight("cat", r) for r in ids]  # type: ignore[arg-type]
        _routing._SCORES.clear()
    assert len({_routing._weight("cat", r) for r in (1, 1.0, True)}) == 3  # type: ignore[arg-type]
    long_key = "u" * (1 << 20)
    policy = CacheAffinity()
    home = policy(RouteRequest(None, [0, 1, 2, 3], [long_key, "cat"]))
    assert home == policy(RouteRequest(None, [0, 1, 2, 3], [long_key, "cat"]))
    assert {key for key, _ in _routing._SCORES} == {"cat"}
