"""Property runs: short by default, long behind one command.

``pytest -m slow tests/properties`` runs the long versions (thousands of examples per
invariant, hundreds per scoping property); without ``-m slow`` the tests marked ``slow``
here are skipped, so the folder stays under a minute. ``OMNI_REQUESTS_LONG=1`` does the
same as ``-m slow`` (as in ``tests/reliability``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expression = config.getoption("markexpr") or ""
    if ("slow" in expression and "not slow" not in expression) or os.environ.get("OMNI_REQUESTS_LONG") == "1":
        return
    skip = pytest.mark.skip(reason="long property run: pytest -m slow tests/properties")
    for item in items:
        if item.get_closest_marker("slow") and HERE in item.path.parents:
            item.add_marker(skip)
