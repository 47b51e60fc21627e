"""Helpers to run prompts through vLLM's real input boundary and compare what comes out.

``render`` does what ``InputProcessor.process_inputs`` does with a raw prompt (parse it
for the model, then ``renderer.render_cmpl``) without the deprecation warning;
``through_boundary`` goes on into ``process_inputs``, which adds the checks vLLM makes
only there (e.g. that every ``mm_hash`` is a ``str``). vLLM and torch are imported
inside the functions: this module must import without them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "assert_same_engine_input",
    "features",
    "render",
    "same_features",
    "through_boundary",
]


def render(renderer: Any, prompt: object) -> dict[str, Any]:
    """vLLM's engine input for ``prompt`` (a str, a token list or a prompt dict)."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(renderer.model_config, prompt)
    (result,) = renderer.render_cmpl([parsed])
    return dict(result)


def through_boundary(renderer: Any, input_processor: Any, prompt: object) -> dict[str, Any]:
    """``render`` then ``InputProcessor.process_inputs``: vLLM's whole input boundary.

    Returns the engine input; raises whatever vLLM raises for a prompt it refuses.
    """
    from vllm import SamplingParams

    result = render(renderer, prompt)
    input_processor.process_inputs("check", result, SamplingParams(max_tokens=1), ("generate",))
    return result


def features(result: Mapping[str, Any]) -> dict[str, list[dict[str, Any] | None]]:
    """The processed tensors per modality and item (``None`` where a cache hit left them out)."""
    found: Mapping[str, Sequence[Any]] = result.get("mm_kwargs") or {}
    return {m: [None if item is None else item.get_data() for item in items] for m, items in found.items()}


def _same_tensors(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same_tensors(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def same_features(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two items' processed tensors are equal (names, dtypes, shapes and values)."""
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)


def assert_same_engine_input(got: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Two engine inputs render the same: tokens, keys, placeholders and processed tensors."""
    assert got["type"] == expected["type"]
    assert list(got["prompt_token_ids"]) == list(expected["prompt_token_ids"])
    assert got.get("prompt") == expected.get("prompt")
    assert got.get("cache_salt") == expected.get("cache_salt")
    assert got.get("mm_hashes") == expected.get("mm_hashes")
    assert got.get("mm_placeholders") == expected.get("mm_placeholders")
    got_features, expected_features = features(got), features(expected)
    assert got_features.keys() == expected_features.keys()
    for modality, items in expected_features.items():
        assert len(got_features[modality]) == len(items)
        for mine, theirs in zip(got_features[modality], items, strict=True):
            assert same_features(mine, theirs), modality
