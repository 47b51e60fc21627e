"""vllm-omni 0.30's own request-path code, run in this process without importing it.

Importing ``vllm_omni`` patches vLLM process-wide, and 0.30 does not import next to vLLM
0.34 (see ``_omni_typeddicts.py``). The code the installed scoping wraps is therefore
read from the installed wheel's source and run as it is, over stand-ins for what it
calls beyond itself: ``AsyncOmniEngine.add_request``, ``_build_add_request_message`` and
``_build_cfg_companions``, ``inject_global_id``, and a model's CFG prompt expansion
(Bagel's, a module of plain Python). The stand-ins record what vllm-omni hands them:
``process_inputs`` the prompts, ``upgrade_to_omni_request`` the raw prompt it restores
the omni-only fields from.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import pathlib
import shutil
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast


def wheel() -> pathlib.Path | None:
    """The installed ``vllm_omni`` package's folder, or None."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def _function(root: pathlib.Path, path: str, name: str, owner: str | None = None) -> str:
    """The source of function ``name`` (a method of class ``owner``) in the wheel's ``path``."""
    body = ast.parse((root / path).read_text()).body
    if owner is not None:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == owner).body
    found = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)
    return "from __future__ import annotations\n" + ast.unparse(found)


def module(root: pathlib.Path, path: str, name: str) -> types.ModuleType:
    """A plain-Python module of the wheel (imports nothing of vllm_omni), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, root / path)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # dataclasses look their module up
    spec.loader.exec_module(loaded)
    return loaded


class _EngineCoreRequest:
    pass


class _OmniEngineCoreRequest(_EngineCoreRequest):
    pass


class Pool:
    """A local stage-0 pool of two replicas: round robin, each request bound to its pick."""

    stage_type = "llm"
    is_distributed = False

    def __init__(self) -> None:
        self.bound: dict[str, int] = {}
        self._turn = 0

    def live_replica_ids(self) -> list[int]:
        return [0, 1]

    def select_replica_id(self, request_id: str, **_: Any) -> int:
        self.bound[request_id] = self._turn % 2
        self._turn += 1
        return self.bound[request_id]

    def release_binding(self, request_id: str) -> None:
        self.bound.pop(request_id, None)


class Processor:
    """``process_inputs``: records each request id and prompt."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def process_inputs(self, *, request_id: str, prompt: Any, **_: Any) -> Any:
        self.calls.append((request_id, prompt))
        return types.SimpleNamespace(reasoning_ended=None, external_req_id=None)


def engine_type(root: pathlib.Path) -> type[Any]:
    """An engine class whose two request-path methods are vllm-omni's own."""
    restored: list[Any] = []
    names: dict[str, Any] = {
        "copy": copy,
        "shutil": shutil,
        "time": time,
        "cast": cast,
        "Any": Any,
        "Literal": Literal,
        "Mapping": Mapping,
        "Sequence": Sequence,
        "EngineCoreRequest": _EngineCoreRequest,
        "OmniEngineCoreRequest": _OmniEngineCoreRequest,
        "TRANSFORM_OWNED_META_KEYS": (),
        "REQUEST_ARTIFACT_DIRS_KEY": module(
            root, "data_entry_keys.py", "_omni_data_entry_keys"
        ).REQUEST_ARTIFACT_DIRS_KEY,
        "StageSubmissionMessage": types.SimpleNamespace,
        "AddCompanionRequestMessage": types.SimpleNamespace,
        "deserialize_additional_information": lambda info: info,
        "apply_omni_final_stage_metadata": lambda request, *_, **__: request,
        # vllm-omni restores the omni-only fields from the raw prompt it is given here.
        "upgrade_to_omni_request": lambda request, raw: (restored.append(raw), request)[1],
        "logger": types.SimpleNamespace(info=print, debug=print, warning=print, exception=print),
    }
    utils = "engine/async_engine_utils.py"
    engine_file = "engine/async_omni_engine.py"
    exec(_function(root, utils, "inject_global_id"), names)
    build: Callable[..., Any]
    for method in ("_build_add_request_message", "_build_cfg_companions", "add_request"):
        exec(_function(root, engine_file, method, "AsyncOmniEngine"), names)
    build, companions = names["_build_add_request_message"], names["_build_cfg_companions"]
    add_request = names["add_request"]

    class Queue:
        """The engine's request queue: what ``add_request`` puts there, in order."""

        def __init__(self) -> None:
            self.sync_q = self
            self.items: list[Any] = []

        def put(self, item: Any) -> None:
            self.items.append(item)

    class Engine:
        """The attributes vllm-omni's two methods and the installed scoping read."""

        model = "/models/tiny-omni"
        upgraded = restored  # the raw prompts upgrade_to_omni_request got

        def __init__(self, prompt_expand_func: Callable[..., Any] | None = None) -> None:
            self.stage_pools = [Pool()]
            self.input_processor = Processor()
            self.default_sampling_params_list = [object()]
            self.supported_tasks = ("generate",)
            self.stage_metadata = [types.SimpleNamespace(stage_type="llm")]
            self.prompt_transform_func = None
            self.prompt_expand_func = prompt_expand_func
            self.request_queue = Queue()

        def _resolve_mm_hasher_algorithm(self) -> str:
            return "blake3"

        def _scope_stage0_multimodal_cache_to_replica(self, request_id: str, prompt: Any) -> int | None:
            raise AssertionError("the installed scoping replaces this")

        def _build_add_request_message(self, *args: Any, **kwargs: Any) -> Any:
            return build(self, *args, **kwargs)

        def _build_cfg_companions(self, *args: Any) -> Any:
            return companions(self, *args)

        def add_request(self, *args: Any, **kwargs: Any) -> None:
            """vllm-omni's own: the message, then its CFG companions (a request past stage 0)."""
            add_request(self, *args, **kwargs)

        def companions_of(self, request_id: str) -> list[Any]:
            """The CFG companion messages ``add_request`` queued for ``request_id``."""
            return [
                item for item in self.request_queue.items if getattr(item, "parent_id", None) == request_id
            ]

    return Engine
