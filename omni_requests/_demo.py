"""The template-reuse scenario, run two ways: plain dicts with write-back, and records.

The dict path is a faithful model of vllm-omni's stage-0 scoping before the upstream fix:
it scopes every media key to the chosen replica and writes the scoped keys back into the
caller's dict. The frontend's processor cache (one "sender" per process) skips sending a
tensor whose key it has seen, and the replica's "receiver" cache then serves whatever it
stored under that key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

from ._hashing import MediaHasher
from ._records import TextPrompt
from ._scoping import rendered_uuids, scope_to_replica

__all__ = ["DemoRow", "format_demo", "run_demo", "sample_videos"]

MODEL_ID = "Qwen/Qwen2.5-Omni-7B"
REPLICAS = 2


def sample_videos() -> dict[str, np.ndarray[Any, Any]]:
    """Four small, distinct, deterministic videos (8 frames of 32x32 RGB)."""
    t, y, x = np.meshgrid(np.arange(8), np.arange(32), np.arange(32), indexing="ij")
    patterns = {
        "sunrise": (y * 8 + t * 4, y * 4, 255 - y * 8),
        "traffic": ((x + t * 4) % 32 * 8, x * 2, t * 16),
        "waves": ((np.sin((x + t) / 3.0) + 1) * 127, y * 8, x * 8),
        "fireworks": (((x - 16) ** 2 + (y - 16) ** 2 < t * 30) * 255, t * 30, x * y % 256),
    }
    return {name: np.stack(channels, axis=-1).astype(np.uint8) for name, channels in patterns.items()}


@attrs.frozen
class DemoRow:
    """One request of the scenario: which video it carried and what the replica served."""

    request: str
    sent: str
    replica: int
    key: str
    served: str


class _Replicas:
    """One sender cache in the frontend and one receiver cache per replica, as in vLLM."""

    def __init__(self) -> None:
        self.sender: set[str] = set()
        self.receivers: list[dict[str, str]] = [{} for _ in range(REPLICAS)]

    def serve(self, replica: int, key: str, video: str) -> str:
        if key in self.sender:  # sender hit: the tensor is not sent again
            return self.receivers[replica].get(key, "(nothing: receiver miss)")
        self.sender.add(key)
        self.receivers[replica][key] = video
        return video


def _old_engine_scope(prompt: dict[str, Any], replica: int, hasher: MediaHasher) -> None:
    """vllm-omni's stage-0 scoping before the fix: scopes keys and writes them back."""
    scoped: dict[str, list[str | None]] = {}
    given = prompt.get("multi_modal_uuids") or {}
    for modality, value in prompt["multi_modal_data"].items():
        items = value if isinstance(value, list) else [value]
        uuids = given.get(modality)
        uuids = [uuids] if isinstance(uuids, str) else uuids
        keys: list[str | None] = []
        for i, item in enumerate(items):
            uuid = uuids[i] if uuids else None
            base = str(uuid) if uuid is not None else hasher.key(modality, item)
            keys.append(f"stage0:rep{replica}:{base}")
        scoped[modality] = keys
    prompt["multi_modal_uuids"] = scoped  # the write-back: the caller's dict now holds engine keys


def _requests() -> Iterator[tuple[str, str]]:
    yield "template (first use)", "sunrise"
    for i, name in enumerate(("traffic", "waves", "fireworks"), start=1):
        yield f"copy {i}", name


def run_demo() -> tuple[list[DemoRow], list[DemoRow]]:
    """Run the scenario both ways, replicas chosen round robin; returns (dict rows, record rows)."""
    videos = sample_videos()
    hasher = MediaHasher(MODEL_ID)

    def rows(send: Callable[[str, int], str]) -> list[DemoRow]:
        engine = _Replicas()
        out = []
        for n, (request, name) in enumerate(_requests()):
            replica = n % REPLICAS
            key = send(name, replica)
            out.append(DemoRow(request, name, replica, key, engine.serve(replica, key, name)))
        return out

    template_dict: dict[str, Any] = {"prompt": "<video> Describe the video.", "multi_modal_data": {}}

    def send_dict(name: str, replica: int) -> str:
        if name == "sunrise":
            prompt = template_dict
            prompt["multi_modal_data"] = {"video": videos[name]}
        else:
            prompt = dict(template_dict)  # a shallow copy of the used template
            prompt["multi_modal_data"] = {"video": videos[name]}
        _old_engine_scope(prompt, replica, hasher)
        key: str = prompt["multi_modal_uuids"]["video"][0]
        return key

    template = TextPrompt(prompt="<video> Describe the video.", multi_modal_data={"video": videos["sunrise"]})
    used: list[TextPrompt] = []

    def send_record(name: str, replica: int) -> str:
        prompt = template if not used else attrs.evolve(used[0], multi_modal_data={"video": videos[name]})
        scoped = scope_to_replica(prompt, replica, hasher=hasher)
        used.append(scoped)
        keys = rendered_uuids(scoped) or {}
        return str(keys["video"][0])

    return rows(send_dict), rows(send_record)


def _short(key: str) -> str:
    head, _, digest = key.rpartition(":")
    return f"{head}:{digest[:10]}..." if head else f"{digest[:10]}..."


def format_demo(dict_rows: list[DemoRow], record_rows: list[DemoRow]) -> str:
    """The two runs as a side-by-side report."""
    lines = [
        f"Template reuse over {REPLICAS} stage-0 replicas (model id {MODEL_ID!r}).",
        "A prompt is used once, then copied three times with a new video each time.",
        "",
    ]
    for title, rows in (
        (
            "Plain dicts, scoped keys written back into the caller's dict (vllm-omni before the fix):",
            dict_rows,
        ),
        ("omni-requests records (frozen; scoping returns a new record):", record_rows),
    ):
        lines.append(title)
        lines.append(f"  {'request':<22}{'sent':<11}{'rep':<5}{'key':<47}served")
        for row in rows:
            mark = "" if row.served == row.sent else "   <-- WRONG FEATURES"
            lines.append(
                f"  {row.request:<22}{row.sent:<11}{row.replica:<5}{_short(row.key):<47}{row.served}{mark}"
            )
        keys = {row.key for row in rows}
        wrong = sum(row.served != row.sent for row in rows)
        lines.append(
            f"  {len(keys)} distinct keys for {len(rows)} different videos; "
            f"requests served another video's features: {wrong}"
        )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
