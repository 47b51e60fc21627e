"""The code of docs/property-testing.md runs, as written, and its tests pass."""

from __future__ import annotations

import linecache
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

PAGE = Path(__file__).parents[2] / "docs" / "property-testing.md"


def _code_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.DOTALL)


@pytest.fixture
def small_profile() -> Iterator[None]:
    """The page's tests run under the current profile; keep their searches short here."""
    previous = settings.get_current_profile_name()
    settings.register_profile(
        "docs-page",
        max_examples=8,
        database=None,
        derandomize=True,  # the page's failing example must fail every run
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("docs-page")
    try:
        yield
    finally:
        settings.load_profile(previous)


def test_the_page_has_its_examples() -> None:
    assert len(_code_blocks()) == 4


@pytest.mark.usefixtures("small_profile")
def test_the_page_runs() -> None:
    namespace: dict[str, Any] = {"__name__": "property_testing_page"}
    for number, block in enumerate(_code_blocks()):
        # Each block under a name of its own whose source linecache holds: Hypothesis
        # reads a test's source (inspect.getsource), which read from the page itself
        # lands on the wrong lines (Python 3.12's tokenizer refuses them).
        name = f"{PAGE}, block {number + 1}"
        linecache.cache[name] = (len(block), None, block.splitlines(keepends=True), name)
        exec(compile(block, name, "exec"), namespace)
    tests = {name: value for name, value in namespace.items() if name.startswith("test_")}
    assert set(tests) == {
        "test_record_scoping_is_safe",
        "test_engine_scoping_is_safe",
        "test_the_old_engine_gives_copies_the_template_key",
        "test_copies_never_share_a_key_with_their_template",
    }
    for test in tests.values():
        test()


def test_the_shown_failure_looks_like_what_the_checks_print() -> None:
    from omni_requests.testing import ScopingPropertyError, check_scoping
    from omni_requests_vllm import to_vllm

    from . import _scopers

    found = re.search(r"```text\nScopingPropertyError: (.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)
    assert found is not None
    shown = found.group(1).strip().splitlines()
    replay = settings(max_examples=25, database=None, derandomize=True)
    with pytest.raises(ScopingPropertyError) as failure:
        check_scoping(
            _scopers.old_write_back,
            to_dict=to_vllm,
            properties=["distinct_media_distinct_keys"],
            settings=replay,
        )
    printed = str(failure.value).strip().splitlines()
    # The same report, line for line, up to the example Hypothesis happens to find.
    assert printed[0] == shown[0]

    def outline(lines: list[str]) -> list[str]:
        return [line for line in lines if not line.startswith(" ")]

    assert outline(printed) == outline(shown)
    assert any("stage0:rep0:stage0:rep0:" in line for line in printed)
