"""vllm-omni's own engine, live: one 2-replica stage 0 on the CPU, shared by the tests.

These tests need ``.venv-omni`` (``make .venv-omni/.ready``: vllm-omni 0.30 over the CPU
build of vLLM 0.30, plus ``tests/omni_engine/support``). Elsewhere they skip, saying so;
``OMNI_REQUESTS_REQUIRE_OMNI=1`` (set by the Makefile) turns a missing vllm-omni into an error.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# The support package is no test module: it has no doctests, and importing it by path
# beside its installed copy would load it twice.
collect_ignore = ["support"]

OMNI_MISSING = (
    "vllm-omni is not installed here: `make test` builds .venv-omni "
    "(requirements/omni-engine.txt) and runs these tests there"
)
if os.environ.get("OMNI_REQUESTS_REQUIRE_OMNI") and importlib.util.find_spec("vllm_omni") is None:
    # `make test-omni-engine` sets it: a broken .venv-omni must fail, not skip.
    raise RuntimeError("OMNI_REQUESTS_REQUIRE_OMNI is set but vllm-omni is not installed here")
DEPLOY = Path(__file__).with_name("deploy.yaml")
MAX_TOKENS = 4


def video(seed: int) -> np.ndarray:
    """A (4, 56, 56, 3) uint8 video, distinct per seed: 8 tokens for the tiny Qwen2-VL."""
    return np.random.default_rng(seed).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)


def answer(output: Any) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """An ``OmniRequestOutput``'s greedy tokens and their logprobs, comparable with ``==``."""
    completion = output.outputs[0]
    tokens = tuple(completion.token_ids)
    logprobs = tuple(
        float(step[token].logprob) for step, token in zip(completion.logprobs, tokens, strict=True)
    )
    return tokens, logprobs


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ._tiny_model import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="session")
def omni(tiny_model: Path) -> Iterator[Any]:
    """vllm-omni's ``Omni`` over the tiny model: stage 0 on two CPU replicas (about a minute to start)."""
    pytest.importorskip("vllm_omni", reason=OMNI_MISSING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from omni_engine_support.pipeline import register
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.platforms import current_omni_platform

    if type(current_omni_platform).__qualname__ != "CpuOmniPlatform":
        pytest.fail(
            f"vllm-omni picked {type(current_omni_platform).__qualname__}, not the CPU platform of "
            "tests/omni_engine/support: is it installed in this venv? (see test_support.py)"
        )
    register()  # this process resolves the pipeline too; engine cores get it as a plugin
    engine = Omni(model=str(tiny_model), deploy_config=str(DEPLOY))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
def generate(omni: Any) -> Callable[[Any], tuple[tuple[int, ...], tuple[float, ...]]]:
    """Send one prompt (a dict or a record) alone and return its tokens and logprobs."""

    def run(prompt: Any) -> tuple[tuple[int, ...], tuple[float, ...]]:
        (output,) = omni.generate(prompt, use_tqdm=False)
        return answer(output)

    return run


@pytest.fixture
def sent_keys(omni: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The media keys of each request as the engine processed them (its ``mm_features``).

    Wraps whatever ``process_inputs`` the engine's input processor has now (its own or
    an installed one), calling it as it is.
    """
    processor = omni.engine.input_processor
    real = processor.process_inputs
    seen: list[list[str]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        request = real(*args, **kwargs)
        seen.append([feature.identifier for feature in request.mm_features or ()])
        return request

    monkeypatch.setattr(processor, "process_inputs", recording)
    return seen
