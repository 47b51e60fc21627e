"""The wire format: encode plus decode of a 3-item request, against pickle and vLLM's msgpack.

The request is one record holding a 177 MB video (64 frames of 720p RGB), a 1080p image
and 30 s of 16 kHz audio as ``(waveform, rate)``, with a user UUID and a cache salt. Each
round trip is timed whole (bytes out, record back):

- ``wire``: ``decode(encode(record))`` of :mod:`omni_requests.wire`: one message, every
  buffer copied into it and out again into ``bytes`` the arrays are backed by (from 64 KiB
  once more, onto pages no one can write); decoding runs the records' constructors.
- ``pickle``: ``pickle.loads(pickle.dumps(record, protocol=5))`` of the same record
  (unsafe on untrusted bytes, which is why the wire format exists).
- ``vLLM``: ``MsgpackDecoder().decode(MsgpackEncoder().encode(to_vllm(record)))`` of
  ``vllm.v1.serial_utils`` on the equivalent engine dict. Its encoder hands large buffers
  out of band (no copy) and its untyped decoder returns them as ``[dtype, shape,
  memoryview]`` lists, without rebuilding arrays, tuples or a record: a lower bound for
  moving the same data, not the same work.

Ratios are wire's time over the other's on the fastest rounds of one run (>1: wire slower).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_requests import TextPrompt

from ._harness import Row, compare

MB = 1_000_000


def request(quick: bool) -> TextPrompt:
    rng = np.random.default_rng(5)
    frames = 6 if quick else 64  # 64 x 720 x 1280 x 3 = 177 MB
    return TextPrompt(
        prompt="<video><image><audio> What happens?",
        multi_modal_data={
            "video": rng.integers(0, 256, (frames, 720, 1280, 3), dtype=np.uint8),
            "image": rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8),
            "audio": (rng.standard_normal(480_000).astype(np.float32), 16000),
        },
        multi_modal_uuids={"image": ["poster-1"]},
        cache_salt="tenant-a",
    )


def run(quick: bool) -> list[Row]:
    from omni_requests.wire import decode, encode
    from omni_requests_vllm import to_vllm

    record = request(quick)
    video_mb = record.multi_modal_data["video"][0].nbytes / MB
    candidates: dict[str, Callable[[], object]] = {
        "wire": lambda: decode(encode(record)),
        "pickle": lambda: pickle.loads(pickle.dumps(record, protocol=5)),
    }
    try:
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    except ImportError:
        vllm_note = "vLLM not installed"
    else:
        encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
        sent: Any = to_vllm(record)
        candidates["vLLM"] = lambda: decoder.decode(encoder.encode(sent))
        vllm_note = ""
    assert decode(encode(record)) == record
    t = compare(candidates, repeat=3 if quick else 7, warmup=1)
    wire = t["wire"]
    label = f"3-item request, video {video_mb:.0f} MB"
    rows = [
        Row(
            "wire",
            f"{label}: wire vs pickle",
            wire.best * 1e3,
            "ms",
            baseline=f"pickle {t['pickle'].best * 1e3:.1f} ms",
            ratio=wire.best / t["pickle"].best,
            note=f"medians {wire.median * 1e3:.1f} / {t['pickle'].median * 1e3:.1f} ms; ratio = wire / pickle",
        )
    ]
    if "vLLM" in t:
        rows.append(
            Row(
                "wire",
                f"{label}: wire vs vLLM msgpack",
                wire.best * 1e3,
                "ms",
                baseline=f"vLLM {t['vLLM'].best * 1e3:.1f} ms",
                ratio=wire.best / t["vLLM"].best,
                note="ratio = wire / vLLM; vLLM keeps buffers out of band and rebuilds no arrays",
            )
        )
    else:
        rows.append(Row("wire", f"{label}: wire vs vLLM msgpack", wire.best * 1e3, "ms", note=vllm_note))
    return rows
