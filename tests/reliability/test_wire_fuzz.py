"""Fuzzing the wire format: decode takes any bytes and gives a record or one of our errors.

The default run tries a few hundred inputs per target: random bytes, valid messages with
bytes flipped, cut or inserted, and well-formed msgpack trees of the format's shapes
(tags, records, fields) holding wrong values. ``pytest -m slow tests/reliability`` runs
100k inputs through the coverage-guided fuzzer (``wire_fuzz.py``, atheris) and a long
Hypothesis run.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

msgspec = pytest.importorskip("msgspec")

from omni_requests import KeyPolicy, MediaHasher, TextPrompt, TokensPrompt, scope_to_replica  # noqa: E402
from omni_requests.wire import WIRE_VERSION, encode  # noqa: E402

from .wire_fuzz import HEADER, check, write_seeds  # noqa: E402

ROOT = Path(__file__).parents[2]
QUICK = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
LONG = settings(QUICK, max_examples=30_000)

_IMAGE = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
VALID = [
    encode(TextPrompt(prompt="x")),
    encode(
        scope_to_replica(
            TextPrompt(
                prompt="<image>",
                multi_modal_data={"image": [_IMAGE, None], "audio": (np.zeros(3, ">f4"), 16000)},
                multi_modal_uuids={"image": [None, "u"]},
                mm_processor_kwargs={"a": [1, (2.5, b"x")], "big": 2**70, "s": np.int16(3)},
            ),
            1,
            hasher=MediaHasher("m", "sha256"),
            policy=KeyPolicy(namespaces=True, tenant="t"),
        )
    ),
    encode(TokensPrompt(prompt_token_ids=[1, 2], multi_modal_data={"video": [_IMAGE[None]]})),
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, max(len(data) - 1, 0)))
        action = draw(st.sampled_from(("flip", "cut", "insert", "set")))
        if action == "flip" and data:
            data[where] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del data[where : where + draw(st.integers(1, 16))]
        elif action == "insert":
            data[where:where] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            data[where] = draw(st.integers(0, 255))
    return bytes(data)


_NAMES = st.sampled_from(
    [
        "prompt",
        "prompt_token_ids",
        "multi_modal_data",
        "multi_modal_uuids",
        "scope",
        "mm_processor_kwargs",
        "encoder_prompt",
        "decoder_prompt",
        "prompt_embeds",
        "cache_salt",
        "image",
        "video",
        "audio",
        "x",
    ]
)
_TAGS = st.integers(0, 10).map(lambda code: msgspec.msgpack.Ext(code, b""))
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=64)
    | _NAMES
    | st.sampled_from(["<i4", "|u1", ">f8", "|O8", "RGB", "P", "text", "tokens"])
)
_TREES = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(_TAGS, st.lists(inner, max_size=8)).map(lambda t: [t[0], *t[1]])
        | st.dictionaries(_NAMES | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def shaped(draw: st.DrawFn) -> bytes:
    """A valid header over a msgpack tree shaped like a record, holding drawn values."""
    kind = draw(st.sampled_from(["text", "tokens", "embeds", "encoder_decoder", "other"]))
    fields = draw(st.dictionaries(_NAMES, _TREES, max_size=3))
    body: Any = [msgspec.msgpack.Ext(1, b""), kind, fields] if draw(st.booleans()) else draw(_TREES)
    return msgspec.msgpack.encode(["omni-requests", WIRE_VERSION, body])


def test_valid_messages_pass_the_contract() -> None:
    for message in VALID:
        check(message)
        assert message.startswith(HEADER)


@QUICK
@given(st.binary(max_size=256))
def test_random_bytes(data: bytes) -> None:
    check(data)
    check(HEADER + data)


@QUICK
@given(mutated())
def test_mutated_messages(data: bytes) -> None:
    check(data)


@settings(QUICK, max_examples=150)  # drawing trees costs more than decoding them
@given(shaped())
def test_shaped_messages(data: bytes) -> None:
    check(data)


# -- full size: pytest -m slow tests/reliability --


@pytest.mark.slow
@LONG
@given(st.one_of(mutated(), shaped(), st.binary(max_size=256).map(lambda b: HEADER + b)))
def test_wire_long(data: bytes) -> None:
    check(data)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None, reason="needs atheris: pip install '.[fuzz]'"
)
def test_wire_atheris_100k(tmp_path: Path) -> None:
    seeds = tmp_path / "seeds"
    write_seeds(seeds)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.reliability.wire_fuzz",
            "-atheris_runs=100000",
            "-max_len=4096",
            str(seeds),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        timeout=3000,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Done 100000 in" in done.stderr, done.stderr[-2000:]
