"""The installed package works for type checkers outside this repository.

A project that uses an editable install of omni-requests must see its types: mypy,
run from another folder, finds both the core and the adapters through the install's
``.pth`` file (setuptools' editable install of this layout was an import hook mypy
cannot follow: "Cannot find implementation or library stub").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

USER_CODE = """\
from omni_requests import TextPrompt
from omni_requests_vllm import to_vllm

record = TextPrompt(prompt="x")
reveal_type(record.prompt)
sent = to_vllm(record)
"""


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="needs mypy (the lint extra)")
def test_mypy_finds_the_installed_package_from_another_project(tmp_path: Path) -> None:
    try:
        importlib.metadata.distribution("omni-requests")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("omni-requests is not installed in this environment")
    project = tmp_path / "user-project"
    project.mkdir()
    (project / "use.py").write_text(USER_CODE)
    # vLLM and torch (which the adapters' types name) take minutes to check: not what this test is about.
    (project / "mypy.ini").write_text(
        "[mypy]\n\n[mypy-vllm.*,torch.*,transformers.*,vllm_omni.*]\nfollow_imports = skip\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--python-executable",
            sys.executable,
            "--cache-dir",
            str(tmp_path / "cache"),
            "use.py",
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = done.stdout + done.stderr
    assert "Cannot find implementation" not in out, out
    assert 'Revealed type is "str"' in out or 'Revealed type is "builtins.str"' in out, out
    assert done.returncode == 0, out
