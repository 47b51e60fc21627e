"""Adapters reach the core's internals through one declared seam, ``omni_requests._adapter_api``.

Everything else private stays private: no adapter imports a private module or name of
the core, reads a record's private slots or calls a hasher's private methods. The walk
is over the adapters' source (an AST, not a regex), so a new module is covered too.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import omni_requests
from omni_requests import OmniRequestsError, PromptTypeError

ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"
SEAM = "omni_requests._adapter_api"


def _core_private_attributes() -> frozenset[str]:
    """Private attribute names of the core's public classes (slots, methods, state)."""
    names: set[str] = set()
    for name in omni_requests.__all__:
        value = getattr(omni_requests, name)
        if inspect.isclass(value):
            names.update(n for n in dir(value) if n.startswith("_") and not n.startswith("__"))
    return frozenset(names)


def seam_violations(source: str, filename: str, private: frozenset[str]) -> list[str]:
    """Where ``source`` crosses into the core other than through the seam."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module == SEAM or module.split(".")[0] != "omni_requests":
                continue
            if module != "omni_requests":
                found.append(f"{where}: imports from {module} (use {SEAM})")
            found += [
                f"{where}: imports {a.name} from omni_requests" for a in node.names if a.name.startswith("_")
            ]
        elif isinstance(node, ast.Import):
            found += [
                f"{where}: imports {a.name}"
                for a in node.names
                if a.name.startswith("omni_requests.") and a.name != SEAM
            ]
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{where}: reads .{node.attr}, private to the core")
    return found


def test_adapters_cross_into_the_core_only_through_the_seam() -> None:
    private = _core_private_attributes()
    assert {"_memo", "_view", "_content_key"} <= private  # the walk knows what it guards
    sources = sorted(ADAPTERS.rglob("*.py"))
    assert len(sources) >= 8
    found = [v for path in sources for v in seam_violations(path.read_text(), path.name, private)]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "from omni_requests._errors import type_name",
        "from omni_requests._media import thaw",
        "from omni_requests import _keys",
        "import omni_requests._scoping",
        "def f(prompt):\n    return prompt._memo",
        "def f(prompt):\n    return prompt._view",
        "def f(hasher, m, x):\n    return hasher._content_key(m, x)",
    ],
)
def test_the_walk_finds_each_way_across(source: str) -> None:
    assert seam_violations(source, "x.py", _core_private_attributes()) != []


def test_the_seam_itself_and_public_names_pass() -> None:
    source = (
        "from omni_requests import TextPrompt, rendered_uuids\n"
        "from omni_requests._adapter_api import derived, media_rows\n"
        "def f(self):\n    return self._keys\n"
    )
    assert seam_violations(source, "x.py", _core_private_attributes()) == []


def test_errors_reroot_their_path_as_structure() -> None:
    inner = PromptTypeError("$.multi_modal_uuids.image[1]", "must be a str")
    outer = inner.under("$[2]")
    assert (type(outer), outer.path, outer.message) == (
        PromptTypeError,
        "$[2].multi_modal_uuids.image[1]",
        "must be a str",
    )
    assert inner.path == "$.multi_modal_uuids.image[1]"  # the inner error is untouched
    assert PromptTypeError("$", "bad").under("$.encoder_prompt").path == "$.encoder_prompt"
    assert PromptTypeError("hasher", "bad").under("$[0]").path == "$[0].hasher"
    assert isinstance(outer, (OmniRequestsError, TypeError))
