"""Print vllm-omni's prompt TypedDicts as JSON. Run in a subprocess only.

Importing ``vllm_omni`` patches vLLM classes process-wide, so the test suite never
imports it itself. vllm-omni 0.30 imports only next to vLLM 0.30 (against 0.34 its
package ``__init__`` fails on ``vllm.v1.outputs.RoutedExpertsLists``); with another vLLM
this loads ``vllm_omni.inputs.data`` under a bare parent package, which runs that
module's own code (the TypedDicts, inheriting from the installed vLLM's prompt types)
and none of the package's patches.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
import types


def _major_minor(distribution: str) -> tuple[str, ...]:
    return tuple(importlib.metadata.version(distribution).split(".")[:2])


def main() -> None:
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or spec.submodule_search_locations is None:
        raise SystemExit("vllm_omni is not installed")
    mode = "package"
    if _major_minor("vllm") != _major_minor("vllm-omni"):
        mode = "bare-parent"
        parent = types.ModuleType("vllm_omni")
        parent.__path__ = list(spec.submodule_search_locations)
        sys.modules["vllm_omni"] = parent
    data = importlib.import_module("vllm_omni.inputs.data")
    out: dict[str, object] = {
        "mode": mode,
        "vllm": importlib.metadata.version("vllm"),
        "vllm_omni": importlib.metadata.version("vllm-omni"),
    }
    for name in ("OmniTextPrompt", "OmniTokensPrompt", "OmniEmbedsPrompt"):
        kind = getattr(data, name)
        out[name] = {
            "fields": {field: str(annotation) for field, annotation in kind.__annotations__.items()},
            "required": sorted(kind.__required_keys__),
        }
    print("JSON:" + json.dumps(out))


if __name__ == "__main__":
    main()
