"""Reliability runs: short by default, full size behind one command.

``pytest -m slow tests/reliability`` runs the full-size versions (>= 100k fuzzed inputs,
16 threads x 10k scopings); without ``-m slow`` the tests marked ``slow`` here are
skipped, so the default suite stays fast. ``OMNI_REQUESTS_LONG=1`` does the same as
``-m slow`` for runners that cannot pass a marker expression.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent

# A script run by hand (it needs atheris, which is not a test dependency); keep pytest's
# --doctest-modules from importing it.
collect_ignore = ["fuzz_atheris.py"]


def long_runs(config: pytest.Config) -> bool:
    """True when the full-size runs were asked for."""
    expression = config.getoption("markexpr") or ""
    asked = "slow" in expression and "not slow" not in expression
    return asked or os.environ.get("OMNI_REQUESTS_LONG") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if long_runs(config):
        return
    skip = pytest.mark.skip(reason="full-size reliability run: pytest -m slow tests/reliability")
    for item in items:
        if item.get_closest_marker("slow") and HERE in item.path.parents:
            item.add_marker(skip)


@pytest.fixture
def long(request: pytest.FixtureRequest) -> bool:
    return long_runs(request.config)


@pytest.fixture(autouse=True)
def _fast_image_road() -> None:
    """Each test starts on the fast image road: a wait for the GIL that an earlier test
    met (a loaded CI machine) would otherwise send its images down the one-piece road."""
    from omni_requests import _image_road

    _image_road._contended_until = 0.0
