"""Documented claims that no other test proved (a docs audit found them).

Each test says how it would fail were its claim false.
"""

from __future__ import annotations

import inspect
import mmap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import DeadlineExceeded

from omni_requests import SinglePrompt
from omni_requests.testing import check_scoping
from omni_requests.wire import DEFAULT_MAX_BYTES, WireError, decode

from .properties._scopers import ours

GiB = 1 << 30


# -- docs/wire.md: decode refuses a message over max_bytes "(default 2 GiB)" -----------


def test_decode_max_bytes_defaults_to_2_gib() -> None:
    # Were the default another number, this fails; the boundary test below shows the
    # default is the one decode applies.
    assert inspect.signature(decode).parameters["max_bytes"].default == 2 * GiB
    assert 2 * GiB == DEFAULT_MAX_BYTES


@pytest.fixture
def sparse_file(tmp_path: Path) -> Iterator[Any]:
    with (tmp_path / "message").open("w+b") as file:
        yield file


def _mapped(file: Any, size: int) -> mmap.mmap:
    """``size`` zero bytes, read-only, from a sparse file: no disk, no memory until read."""
    file.truncate(size)
    return mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)


def test_decode_without_max_bytes_refuses_one_byte_over_2_gib_and_reads_2_gib(sparse_file: Any) -> None:
    # decode compares the buffer's size (memoryview(data).nbytes) with max_bytes before
    # reading a byte; the message has no length field of its own to forge. A sparse,
    # memory-mapped file gives a real buffer of 2 GiB (+ 1) without allocating it.
    # Were the default limit higher, the 2 GiB + 1 message would be read and refused as
    # "not an omni-requests wire message" (its bytes are zeros), not for its size; were it
    # lower, the 2 GiB message would be refused for its size.
    over = r"the message is 2147483649 bytes, over max_bytes=2147483648$"
    with (
        _mapped(sparse_file, 2 * GiB + 1) as message,
        memoryview(message) as view,
        pytest.raises(WireError, match=over),
    ):
        decode(view)
    with (
        _mapped(sparse_file, 2 * GiB) as message,
        memoryview(message) as view,
        pytest.raises(WireError, match=r"not an omni-requests wire message$"),
    ):
        decode(view)


# -- check_scoping without settings=: the current profile, with no deadline -----------
# docs/property-testing.md, "Tuning the search"; omni_requests.testing.check_scoping.

SLEEP_S = 0.1
DEADLINE_MS = 50
MAX_CALLS = 3  # the least check_scoping takes: a scenario makes at most this many calls


@pytest.fixture
def profile_of() -> Iterator[Any]:
    """Load a Hypothesis profile of ``max_examples`` with a 50 ms deadline; the previous
    profile comes back after the test."""
    previous = settings.get_current_profile_name()

    def load(max_examples: int) -> None:
        name = f"claims-audit-{max_examples}"
        settings.register_profile(name, max_examples=max_examples, deadline=DEADLINE_MS, database=None)
        settings.load_profile(name)

    try:
        yield load
    finally:
        settings.load_profile(previous)


def test_the_profile_deadline_fails_a_plain_test_that_sleeps(profile_of: Any) -> None:
    # The control: under this profile the deadline does fail a Hypothesis test whose
    # example sleeps as long as the scoper below sleeps per call.
    profile_of(2)

    @given(st.just(None))
    def sleeps(_: None) -> None:
        time.sleep(SLEEP_S)

    with pytest.raises(DeadlineExceeded):
        sleeps()


def test_check_scoping_without_settings_takes_the_profile_but_no_deadline(profile_of: Any) -> None:
    calls: list[int] = []

    def slow_ours(prompt: SinglePrompt, replica: int) -> Any:
        calls.append(replica)
        time.sleep(SLEEP_S)  # twice the profile's 50 ms deadline, in one call
        return ours(prompt, replica)

    counted: dict[int, int] = {}
    for max_examples in (2, 6):
        profile_of(max_examples)
        calls.clear()
        # Were the profile's deadline applied, this raises DeadlineExceeded (as the plain
        # test above does), since every example sleeps at least 0.1 s.
        check_scoping(slow_ours, properties=["one_scope_prefix"], max_calls=MAX_CALLS)
        counted[max_examples] = len(calls)
    # The profile's max_examples bounds the search: at most max_examples scenarios of at
    # most MAX_CALLS calls each. Were the profile ignored (Hypothesis' default of 100
    # examples, or a number of check_scoping's own), the 2-example run would make more
    # than 6 calls, or the 6-example run no more calls than it.
    assert 1 <= counted[2] <= 2 * MAX_CALLS
    assert 2 * MAX_CALLS < counted[6] <= 6 * MAX_CALLS
