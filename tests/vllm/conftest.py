"""Fixtures for the tests that run the real vLLM: tiny model folders and their renderers.

Everything here is built offline in a temporary folder: three weightless model folders
(LLaVA for images, Qwen2-VL for images and videos, Qwen2-Audio for audio) that vLLM's
input side (renderer, multimodal processor, ``InputProcessor``) accepts on the CPU.

Without vLLM installed every module here skips itself with the reason
(``pytest.importorskip`` first thing, so nothing here imports vLLM before that); set
``OMNI_REQUESTS_REQUIRE_VLLM=1`` to make a missing vLLM an error instead, so a broken
install cannot pass as a green run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _tiny_models as tm
import pytest
from _tiny_models import TinyModel

if os.environ.get("OMNI_REQUESTS_REQUIRE_VLLM"):
    import vllm  # noqa: F401 - where vLLM must be installed, its absence is an error

HERE = Path(__file__).parent

# torch warns (once per process) when the HF processors wrap a read-only array in a
# tensor; records hand vLLM read-only views on purpose. Only this message, only here.
READ_ONLY_ARRAY_WARNING = "ignore:The given NumPy array is not writable:UserWarning"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.filterwarnings(READ_ONLY_ARRAY_WARNING))


_ARCHITECTURES = (
    "llava-LlavaForConditionalGeneration",
    "qwen2_vl-Qwen2VLForConditionalGeneration",
    "qwen2_audio-Qwen2AudioForConditionalGeneration",
)


def _warm_model_info_cache() -> None:
    """Fill vLLM's model-info cache only where it is cold (14 s once, not 6-9 s per model)."""
    import vllm.envs as envs

    cache = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    names = [f"vllm-model_executor-models-{arch}.json" for arch in _ARCHITECTURES]
    if not all((cache / name).exists() for name in names):
        tm.warm_model_info_cache()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    """The three tiny models by name: ``llava``, ``qwen2_vl``, ``qwen2_audio``."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    _warm_model_info_cache()
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "llava": TinyModel("llava", tm.make_llava(root / "llava"), ("image",), tm.llava_prompt),
        "qwen2_vl": TinyModel(
            "qwen2_vl", tm.make_qwen2_vl(root / "qwen2_vl"), ("image", "video"), tm.qwen2_vl_prompt
        ),
        "qwen2_audio": TinyModel(
            "qwen2_audio", tm.make_qwen2_audio(root / "qwen2_audio"), ("audio",), tm.qwen2_audio_prompt
        ),
    }


@pytest.fixture(scope="session")
def llava(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["llava"]


@pytest.fixture(scope="session")
def qwen2_vl(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["qwen2_vl"]


@pytest.fixture(scope="session")
def qwen2_audio(tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models["qwen2_audio"]


RendererFactory = Callable[..., Any]


@pytest.fixture(scope="session")
def uncached_renderer(tiny_models: dict[str, TinyModel]) -> Iterator[RendererFactory]:
    """``uncached_renderer(name, **model_config)``: one shared renderer per arguments.

    Its processor cache is off (``mm_processor_cache_gb=0``; prefix caching keeps content
    hashes on), so what it returns never depends on what an earlier test rendered:
    every result carries its processed tensors, and a cached-only (``None``) item fails.
    """
    built: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}

    def get(name: str, **model_config: Any) -> Any:
        key = (name, tuple(sorted(model_config.items())))
        if key not in built:
            built[key] = tm.build_renderer(
                tiny_models[name].folder, **{"mm_processor_cache_gb": 0, **model_config}
            )
        return built[key]

    yield get
    built.clear()


@pytest.fixture
def fresh_renderer(tiny_models: dict[str, TinyModel]) -> RendererFactory:
    """``fresh_renderer(name, **model_config)``: a new renderer with vLLM's default caches.

    One renderer is one frontend process: one processor ("sender") cache, empty here.
    """

    def build(name: str, **model_config: Any) -> Any:
        return tm.build_renderer(tiny_models[name].folder, **model_config)

    return build
