"""The test-support package still does its job (tests/omni_engine/support).

vllm-omni 0.30 has no CPU platform and no tiny one-stage pipeline; the support package
adds both through vllm-omni's entry points, and lets PyPI's CUDA torchvision import
beside the CPU torch. Each test here names the piece that stopped working, so a failure
after an upgrade says what to fix before the live-engine tests can mean anything.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from .conftest import OMNI_MISSING

pytest.importorskip("vllm_omni", reason=OMNI_MISSING)
pytestmark = pytest.mark.omni_engine


def test_the_cpu_platform_is_the_one_vllm_omni_picks() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="vllm_omni.platform_plugins")}
    assert found.get("omni_requests_cpu") == "omni_engine_support.platform:activate", (
        "the CPU platform's entry point is gone: reinstall tests/omni_engine/support into .venv-omni"
    )
    from vllm_omni.platforms import current_omni_platform as platform

    resolved = [
        f"{type(platform).__module__}.{type(platform).__qualname__}",
        platform.get_omni_ar_worker_cls(),
        platform.device_control_env_var,
        platform.get_device_count(),
    ]
    assert resolved == [
        "omni_engine_support.platform.CpuOmniPlatform",
        "vllm.v1.worker.cpu_worker.CPUWorker",
        "OMNI_REQUESTS_CPU_DEVICES",
        2,
    ], (
        "vllm-omni no longer picks our CPU platform (or its AR worker, device variable or "
        f"device count changed); it resolved: {resolved}"
    )


def test_the_one_stage_pipeline_registers_and_resolves() -> None:
    from omni_engine_support import PIPELINE
    from omni_engine_support.pipeline import register
    from vllm_omni.config.pipeline_registry import resolve_pipeline_config

    found = {ep.name: ep.value for ep in entry_points(group="vllm_omni.general_plugins")}
    assert found.get("omni_requests_pipeline") == "omni_engine_support.pipeline:register", (
        "the pipeline's general-plugin entry point is gone: engine-core processes would not know it"
    )
    register()
    pipeline = resolve_pipeline_config(PIPELINE)
    assert pipeline is not None, f"register_pipeline no longer makes {PIPELINE!r} resolvable"
    (stage,) = pipeline.stages
    assert (stage.stage_id, stage.execution_type.name, stage.final_output_type) == (0, "LLM_AR", "text")


def test_torchvision_imports_beside_the_cpu_torch() -> None:
    # A fresh process: the .pth hook must run before transformers pulls torchvision in.
    code = (
        "import torchvision.transforms.v2, transformers; print(transformers.Qwen2VLVideoProcessor.__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0 and "Qwen2VLVideoProcessor" in result.stdout, (
        "torchvision no longer imports beside the CPU torch; is the .pth written by "
        "`python -m omni_engine_support.torchvision_ops` still in .venv-omni?\n" + result.stderr[-3000:]
    )
