"""A CPU platform for vllm-omni 0.30, which ships none.

Without it, starting an engine fails in ``get_omni_ar_worker_cls`` with
``NotImplementedError``, and vllm-omni's own AR worker refuses the CPU ("Not support
device type: cpu"). The platform class is vllm-omni's ``OmniPlatform`` (the omni hooks)
over vLLM's ``CpuPlatform`` (everything vLLM itself asks of a platform), and runs the AR
stage on vLLM's own CPU worker. Only the few hooks below differ from those two.

vllm-omni discovers it through the ``vllm_omni.platform_plugins`` entry point, in every
process, and calls :func:`activate`, which names the class.
"""

from __future__ import annotations

from typing import Any

from . import DEVICE_COUNT, DEVICE_VARIABLE

PLATFORM = "omni_engine_support.platform.CpuOmniPlatform"


def activate() -> str:
    """The entry point: this platform's qualified name (vllm-omni imports it lazily)."""
    return PLATFORM


def _platform_class() -> type[Any]:
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

    class CpuOmniPlatform(OmniPlatform, CpuPlatform):  # type: ignore[misc]
        _omni_enum = OmniPlatformEnum.OOT
        # vllm-omni writes each replica's device ids ("0", "1") into this variable.
        # vLLM's own CPU variable would pin replica 1 to a NUMA node that is not there.
        device_control_env_var = DEVICE_VARIABLE

        @classmethod
        def get_omni_ar_worker_cls(cls) -> str:
            return "vllm.v1.worker.cpu_worker.CPUWorker"

        @classmethod
        def get_omni_generation_worker_cls(cls) -> str:
            return "vllm.v1.worker.cpu_worker.CPUWorker"

        @classmethod
        def get_default_stage_config_path(cls) -> str:
            return "vllm_omni/deploy"

        @classmethod
        def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
            return torch.device("cpu")

        @classmethod
        def get_device_count(cls) -> int:
            return DEVICE_COUNT  # one "device" per stage-0 replica

        @classmethod
        def get_device_version(cls) -> str | None:
            return None

        @classmethod
        def synchronize(cls) -> None:
            return None

        @classmethod
        def get_free_memory(cls, device: torch.device | None = None) -> int:
            import psutil

            return int(psutil.virtual_memory().available)

        @classmethod
        def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
            import psutil

            memory = psutil.virtual_memory()
            return int(memory.available), int(memory.total)

    CpuOmniPlatform.__module__ = __name__
    CpuOmniPlatform.__qualname__ = "CpuOmniPlatform"
    return CpuOmniPlatform


def __getattr__(name: str) -> Any:
    # The class is built on first access: importing this module (to run ``activate``)
    # must not import vLLM, which would fix vLLM's own platform too early.
    if name == "CpuOmniPlatform":
        cls = _platform_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
