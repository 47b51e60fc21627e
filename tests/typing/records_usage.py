"""Type-checked in CI (mypy --strict, see pyproject): plain values are accepted where users pass them."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from omni_requests import MediaHasher, MediaKey, TextPrompt, TokensPrompt, media_keys, scope_to_replica
from omni_requests_vllm import from_vllm, to_vllm

image = np.zeros((2, 2, 3), np.uint8)
prompt = TextPrompt(
    prompt="<image>",
    multi_modal_data={"image": [image, None]},
    multi_modal_uuids={"image": [None, "cached"]},
    mm_processor_kwargs={"size": {"shortest_edge": 8}},
    additional_information={"speaker": "a"},
)
tokens = TokensPrompt(prompt_token_ids=[1, 2, 3], multi_modal_data={"audio": (np.zeros(4), 16000)})
copy: TextPrompt = attrs.evolve(prompt, multi_modal_data={"image": image}, multi_modal_uuids=None)
scoped: TextPrompt = scope_to_replica(copy, 1, hasher=MediaHasher("m"))
key: MediaKey | None = media_keys(scoped)["image"][0]
engine_dict: Mapping[str, object] = to_vllm(scoped)  # vLLM's TextPrompt to a type checker
back = from_vllm(to_vllm(copy))  # an engine-scoped dict is refused: it has been through an engine
