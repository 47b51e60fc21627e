"""Type-checked in CI (mypy --strict): records go into vLLM's entry points through ``to_vllm``.

Never run: it only has to type-check against vLLM's own signatures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
from vllm import LLM, RequestOutput, SamplingParams
from vllm.inputs import PromptType
from vllm.v1.engine.async_llm import AsyncLLM

from omni_requests import (
    EncoderDecoderPrompt,
    MediaHasher,
    Prompt,
    TextPrompt,
    TokensPrompt,
    scope_to_replica,
)
from omni_requests_vllm import to_vllm


def generate(llm: LLM, hasher: MediaHasher) -> list[RequestOutput]:
    video = np.zeros((4, 56, 56, 3), np.uint8)
    record = TextPrompt(prompt="<video>", multi_modal_data={"video": video})
    scoped = scope_to_replica(record, 1, hasher=hasher)
    tokens = TokensPrompt(prompt_token_ids=[1, 2, 3])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    one = llm.generate(to_vllm(scoped), params)
    batch: list[PromptType] = [to_vllm(scoped), to_vllm(tokens)]
    many = llm.generate(batch, params)
    return one + many


def generate_any(llm: LLM, prompt: Prompt, pair: EncoderDecoderPrompt) -> list[RequestOutput]:
    batch: list[PromptType] = [to_vllm(prompt), to_vllm(pair)]
    return llm.generate(batch)


async def stream(engine: AsyncLLM, record: TextPrompt) -> AsyncIterator[RequestOutput]:
    async for out in engine.generate(to_vllm(record), SamplingParams(max_tokens=4), "req-1"):
        yield out
