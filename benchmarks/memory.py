"""Memory: 1,000 scoped copies of a template holding a 177 MB video.

Runs in a fresh interpreter (``python -m benchmarks.memory``) so nothing else allocated
in the run moves its RSS. Measured with the resident set size from /proc (psutil where
/proc is missing), after a full collection, before and after building the copies.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

import numpy as np

from ._harness import Row

MB = 1_000_000


def rss() -> int:
    """Resident set size of this process in bytes."""
    gc.collect()
    try:
        with open("/proc/self/statm") as statm:
            import os

            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.Process().memory_info().rss)


def measure(video_mb: int, copies: int) -> dict[str, Any]:
    """RSS added by the template (its own copy of the video), then by ``copies`` scoped
    records, then by their engine dicts, in bytes."""
    from omni_requests import MediaHasher, TextPrompt, scope_to_replica
    from omni_requests_vllm import to_vllm

    hasher = MediaHasher("/models/bench-model")
    frame = 1280 * 720 * 3
    video = np.random.default_rng(2).integers(0, 256, (video_mb * MB // frame, 720, 1280, 3), dtype=np.uint8)
    # Warm the code paths on a small record first, so the template's figure is its copy.
    to_vllm(
        scope_to_replica(
            TextPrompt(prompt="<video>", multi_modal_data={"video": video[:1]}), 1, hasher=hasher
        )
    )
    before_template = rss()
    # The record copies the caller's array once into an immutable bytes-backed one (the
    # caller keeps its own): that copy is the template's memory cost.
    template = TextPrompt(prompt="<video> What happens?", multi_modal_data={"video": video})
    owned = template.multi_modal_data["video"][0]
    assert owned is not video
    to_vllm(scope_to_replica(template, 1, hasher=hasher))  # the video's key, computed once
    start = rss()
    scoped = [scope_to_replica(template, i % 4, hasher=hasher) for i in range(copies)]
    after_records = rss()
    dicts = [to_vllm(p) for p in scoped]
    after_dicts = rss()
    # Fresh views of the very array: no copy of its bytes.
    assert all(d["multi_modal_data"]["video"][0].base is owned.base for d in dicts)  # type: ignore[index,union-attr]
    return {
        "video_bytes": int(video.nbytes),
        "copies": copies,
        "template_bytes": start - before_template,
        "records_bytes": after_records - start,
        "records_and_dicts_bytes": after_dicts - start,
    }


def run(quick: bool) -> list[Row]:
    video_mb, copies = (32, 1000) if quick else (177, 1000)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", str(video_mb), str(copies)],
        check=True,
        capture_output=True,
        text=True,
    )
    m = json.loads(out.stdout)
    size = m["video_bytes"] / MB
    rows = [
        Row(
            "memory",
            f"the template record built from a writable {size:.0f} MB video (its one copy)",
            m["template_bytes"] / MB,
            "MB RSS added",
            baseline=f"the video {size:.0f} MB",
            ratio=m["template_bytes"] / m["video_bytes"],
            note="the caller's array and the record's copy both live while the caller keeps its own",
        )
    ]
    for key, what in (
        ("records_bytes", "records"),
        ("records_and_dicts_bytes", "records + their to_vllm dicts"),
    ):
        added = m[key] / MB
        rows.append(
            Row(
                "memory",
                f"{copies} scoped copies of a {size:.0f} MB video template: {what}",
                added,
                "MB RSS added",
                baseline=f"the video {size:.0f} MB",
                ratio=added / size,
                target="< 5 MB" if what == "records" else "",
                met=added < 5 if what == "records" else None,
            )
        )
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
