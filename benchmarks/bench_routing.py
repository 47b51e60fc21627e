"""Processor-cache hit rate and load balance of stage-0 replica-selection policies.

Run: ``python benchmarks/bench_routing.py`` (``--help`` for the knobs).

What it does: builds a synthetic workload of multimodal requests whose images repeat
with Zipf-like popularity (most requests reuse a few popular images, many images are
seen once), routes every request through :func:`omni_requests_omni.scope_stage0` with
each policy over 2, 4 and 8 stage-0 replicas, and replays the scoped keys against a
model of each replica's processor cache: an LRU of a bounded number of keys. A media
item is a hit when its scoped key is in the cache of the replica the request went to.

Policies: round robin; cache affinity (rendezvous hashing of the request's media keys
over the live replicas); cache affinity with bounded loads, where a replica's load is
the number of requests among the last ``window`` routed to it (a stand-in for its queue).

What it does not show: wall-clock serving speed (no model runs), the cost of a miss
(which depends on the media and the processor), caches bounded by bytes rather than
entries, or replicas joining and leaving during the run. The workload is synthetic;
real traffic may repeat media more or less than this.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:
    import omni_requests_omni  # noqa: F401
except ImportError:  # run from a checkout where the adapter is not installed yet
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters"))

from omni_requests import MediaHasher, TextPrompt, rendered_uuids
from omni_requests_omni import CacheAffinity, RoundRobin, RouteRequest, Stage0Pool, scope_stage0

MEDIA_PER_REQUEST = {0: 0.15, 1: 0.6, 2: 0.2, 3: 0.05}


def make_workload(requests: int, media: int, zipf: float, seed: int) -> list[TextPrompt]:
    """Requests as records; image ``i`` is drawn with probability proportional to 1/(i+1)^zipf."""
    rng = np.random.default_rng(seed)
    catalogue = []
    for i in range(media):
        image = np.random.default_rng(seed * 1_000_003 + i).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        image.flags.writeable = False  # nobody can write it, so its key is computed once
        catalogue.append(image)
    weights = 1.0 / np.arange(1, media + 1) ** zipf
    weights /= weights.sum()
    counts = rng.choice(list(MEDIA_PER_REQUEST), size=requests, p=list(MEDIA_PER_REQUEST.values()))
    prompts = []
    for n in counts:
        chosen = rng.choice(media, size=int(n), replace=False, p=weights) if n else np.empty(0, np.int64)
        data = {"image": [catalogue[i] for i in chosen]} if n else None
        prompts.append(TextPrompt(prompt="<image> " * int(n) + "describe", multi_modal_data=data))
    return prompts


class LRU:
    """A replica's processor cache: the most recently used ``capacity`` keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: collections.OrderedDict[str, None] = collections.OrderedDict()

    def lookup(self, key: str) -> bool:
        """True on a hit; a miss inserts the key, evicting the least recently used."""
        if key in self.keys:
            self.keys.move_to_end(key)
            return True
        self.keys[key] = None
        if len(self.keys) > self.capacity:
            self.keys.popitem(last=False)
        return False


def policies(window: collections.deque[int]) -> dict[str, Callable[[], Any]]:
    """Fresh policy objects per run; the bounded one reads the sliding window's counts."""

    def recent_load(replica: int) -> float:
        return float(window.count(replica))

    return {
        "round-robin": RoundRobin,
        "cache-affinity": CacheAffinity,
        "affinity, bounded 1.25": lambda: CacheAffinity(load=recent_load, max_load_ratio=1.25),
    }


def run(
    prompts: Sequence[TextPrompt],
    replicas: int,
    make_policy: Callable[[], Any],
    capacity: int,
    window: collections.deque[int],
    hasher: MediaHasher,
) -> dict[str, Any]:
    """Route every request, replay its keys against the replica caches, and count."""
    window.clear()
    select = make_policy()
    pool = Stage0Pool(replicas=replicas, select=select)
    caches = [LRU(capacity) for _ in range(replicas)]
    load = [0] * replicas
    hits = items = 0
    started = time.perf_counter()
    for number, prompt in enumerate(prompts):
        replica, scoped = scope_stage0(prompt, pool=pool, hasher=hasher, request_id=f"req-{number}")
        if replica is None:  # no media: the engine's pool routes it later, with the same policy
            replica = select(RouteRequest(f"req-{number}", pool.replicas))
            assert replica is not None
        load[replica] += 1
        window.append(replica)
        prefix = f"stage0:rep{replica}:"
        for row in (rendered_uuids(scoped) or {}).values():
            for key in row:
                assert key is not None
                assert key.startswith(prefix), key  # never another replica's key
                items += 1
                hits += caches[replica].lookup(key)
    elapsed = time.perf_counter() - started
    mean = sum(load) / replicas
    return {
        "hit_rate": hits / max(items, 1),
        "max_over_mean": max(load) / mean,
        "shares": [count / len(prompts) for count in load],
        "us_per_request": elapsed / len(prompts) * 1e6,
    }


def main(argv: Sequence[str] | None = None) -> dict[int, dict[str, dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--media", type=int, default=4_000, help="distinct images in the catalogue")
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity skew (higher: more repeats)")
    parser.add_argument("--capacity", type=int, default=256, help="keys each replica's cache holds")
    parser.add_argument(
        "--window", type=int, default=8, help="in-flight requests per replica (bounded policy)"
    )
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    prompts = make_workload(args.requests, args.media, args.zipf, args.seed)
    hasher = MediaHasher("/models/bench")
    n_items = sum(len(items) for p in prompts for items in p.multi_modal_data.values())
    print(
        f"{args.requests} requests, {n_items} images from a catalogue of {args.media} (zipf {args.zipf}), "
        f"LRU of {args.capacity} keys per replica\n"
    )
    header = f"{'replicas':>8}  {'policy':<24} {'hit rate':>8}  {'max/mean load':>13}  {'us/req':>6}  requests per replica (%)"
    print(header)
    print("-" * len(header))
    results: dict[int, dict[str, dict[str, Any]]] = {}
    for replicas in args.replicas:
        window: collections.deque[int] = collections.deque(maxlen=args.window * replicas)
        results[replicas] = {}
        for name, make_policy in policies(window).items():
            row = run(prompts, replicas, make_policy, args.capacity, window, hasher)
            results[replicas][name] = row
            shares = " ".join(f"{100 * s:.0f}" for s in row["shares"])
            print(
                f"{replicas:>8}  {name:<24} {100 * row['hit_rate']:>7.1f}%  {row['max_over_mean']:>13.2f}"
                f"  {row['us_per_request']:>6.0f}  {shares}"
            )
        print()
    return results


if __name__ == "__main__":
    main()
