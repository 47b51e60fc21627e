"""Documented claims of the vllm-omni adapter that no other test proved (a docs audit found them).

Each test says how it would fail were its claim false.
"""

from __future__ import annotations

import base64
import collections
import struct
import sys
import threading
from typing import Any

import numpy as np
import pytest

from omni_requests_omni import (
    DefaultLoader,
    MediaLoadError,
    RoundRobin,
    RouteRequest,
    chat_to_prompt,
    decode_wav,
)

THREADS = 16
CALLS = 1_000
ROUNDS = 20  # a lost turn shows in about half the rounds (see the test), not every one
REPLICAS = [0, 1, 2, 3]


def test_round_robin_is_thread_safe_every_replica_gets_its_exact_share() -> None:
    """_routing.RoundRobin: "Thread-safe: next on an itertools.count is atomic under the GIL".

    16 threads x 1,000 calls on one policy over 4 replicas: the turn advances exactly once
    per call, so each replica gets exactly 4,000. A counter that loses a turn (two threads
    reading the same value before either writes it back) gives some replica more and
    another fewer. How we know this test catches that: the switch interval is cut to 1 us
    so threads interleave inside ``__call__``; a racy stand-in (``turn = self._turn``, a
    Python-level helper call to pick, then ``self._turn = turn + 1``) failed this check in
    10 runs of 10 under that interval (0 of 10 at the default 5 ms), while RoundRobin
    passed every run.
    """
    policy = RoundRobin()
    request = RouteRequest(None, REPLICAS)  # the same RouteRequest shape a pool hands a policy
    for round_ in range(ROUNDS):
        counts = _contend(policy, request)
        assert counts == {replica: THREADS * CALLS // len(REPLICAS) for replica in REPLICAS}, round_
    # Nothing was lost or repeated: the turns were 0, 1, 2, ... one per call, so the next
    # is the one after the last.
    assert policy(request) == REPLICAS[(ROUNDS * THREADS * CALLS) % len(REPLICAS)]


def _contend(policy: RoundRobin, request: RouteRequest) -> collections.Counter[int | None]:
    """What ``policy`` picks for ``request`` in THREADS threads x CALLS calls, started together."""
    start = threading.Barrier(THREADS)
    picks: list[list[int | None]] = [[] for _ in range(THREADS)]
    failures: list[BaseException] = []

    def work(index: int) -> None:
        try:
            start.wait()
            picks[index] = [policy(request) for _ in range(CALLS)]
        except BaseException as error:  # noqa: BLE001 - reported below, on the test's thread
            failures.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    return collections.Counter(pick for row in picks for pick in row)


# CacheAffinity's docstring makes no thread-safety claim, so none is tested here.


def _wav(format_tag: int, *, width: int, samples: bytes, rate: int = 16000) -> bytes:
    """A one-channel RIFF/WAVE file with a plain 16-byte ``fmt `` chunk of ``format_tag``
    (1: PCM, 2: MS ADPCM, 3: IEEE float), built byte by byte."""
    fmt = struct.pack("<HHIIHH", format_tag, 1, rate, rate * width, width, 8 * width)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body


FLOAT_SAMPLES = np.linspace(-0.5, 0.5, 16, dtype="<f4").tobytes()


def test_the_wav_builder_makes_a_wav_that_decode_wav_reads() -> None:
    # The control for the tests below: the same bytes, with format tag 1 (PCM) in place of
    # 3, decode; so the refusals below are for the format tag, not a malformed file.
    samples, rate = decode_wav(_wav(1, width=4, samples=FLOAT_SAMPLES))
    assert rate == 16000
    assert samples.dtype == np.float32 and samples.shape == (16,)


@pytest.mark.parametrize(
    ("format_tag", "width"),
    [(3, 4), (3, 8), (2, 1)],
    ids=["float32", "float64", "ms-adpcm"],
)
def test_decode_wav_refuses_floating_point_and_compressed_wav(format_tag: int, width: int) -> None:
    """decode_wav: "compressed or floating-point WAV is not [read] (wave refuses it)".

    Were a float WAV read, decode_wav would return samples here (as it does for the same
    bytes tagged PCM, above), and ``pytest.raises`` would fail.
    """
    data = _wav(format_tag, width=width, samples=b"\x00" * (16 * width))
    with pytest.raises(
        MediaLoadError, match=rf"not a PCM WAV file: unknown format: {format_tag}$"
    ) as refused:
        decode_wav(data)
    assert refused.value.path == "$"


def test_chat_to_prompt_without_vllm_refuses_a_floating_point_wav_naming_the_part() -> None:
    """DefaultLoader(use_vllm=False) decodes audio "from PCM WAV" with decode_wav; a float
    WAV in an ``input_audio`` part is refused, the error naming the part
    (``$.messages[0].content[0].input_audio``, as docs/engine-integration.md names parts).
    Were it read, chat_to_prompt would return a prompt and ``pytest.raises`` would fail."""
    clip = base64.b64encode(_wav(3, width=4, samples=FLOAT_SAMPLES)).decode()
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}],
        }
    ]
    with pytest.raises(MediaLoadError, match=r"not a PCM WAV file: unknown format: 3$") as refused:
        chat_to_prompt(messages, loader=DefaultLoader(use_vllm=False))
    assert refused.value.path == "$.messages[0].content[0].input_audio"
    # The same part tagged PCM loads: the refusal is for the float format.
    clip = base64.b64encode(_wav(1, width=4, samples=FLOAT_SAMPLES)).decode()
    messages[0]["content"][0]["input_audio"]["data"] = clip
    prompt = chat_to_prompt(messages, loader=DefaultLoader(use_vllm=False))
    assert len(prompt.multi_modal_data["audio"]) == 1
