"""vLLM's own verdict on items of too few or too many dimensions, which records refuse.

Each refused value goes to vLLM's boundary as given (render, then ``process_inputs``)
and must fail there, on a renderer without processor cache and on a fresh one with vLLM's
default cache; each kept one, through ``to_vllm``, must pass on a fresh default renderer.
(Without the cache, vLLM's processor takes a modality's items in one call, and fails on
some that it takes one by one with the cache: a 4-D image item, which Qwen2-VL's processor
flattens into more images than items, and a tensor waveform in ``(waveform, rate)`` on
Qwen2-Audio. Records keep those, as the default deployment takes them.)
The records' side is ``tests/test_item_dims_and_keys.py``.
"""

from __future__ import annotations

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

from typing import Any

import numpy as np
import torch
from _engine import through_boundary
from _tiny_models import TinyModel

from omni_requests import PromptTypeError, TextPrompt
from omni_requests_vllm import to_vllm

pytestmark = pytest.mark.vllm

META = {"fps": 1.0}


def u8(*shape: int) -> np.ndarray[Any, Any]:
    return np.zeros(shape, np.uint8)


def f32(*shape: int) -> np.ndarray[Any, Any]:
    return np.zeros(shape, np.float32)


def _model(modality: str) -> str:
    return "qwen2_audio" if modality == "audio" else "qwen2_vl"


# (modality, value, the items vLLM's parser splits it into)
REFUSED: dict[str, tuple[str, Any, int]] = {
    "video (1-D array, meta)": ("video", [(u8(28), META)], 1),
    "video (2-D array, meta)": ("video", [(u8(28, 28), META)], 1),
    "video (2-D tensor, meta)": ("video", [(torch.zeros(28, 28), META)], 1),
    "video (5-D array, meta)": ("video", [(u8(1, 2, 28, 28, 3), META)], 1),
    "video (5-D tensor, meta)": ("video", [(torch.zeros(1, 2, 28, 28, 3), META)], 1),
    "video [4-D, 5-D]": ("video", [u8(2, 28, 28, 3), u8(1, 2, 28, 28, 3)], 2),
    "video [5-D tensor]": ("video", [torch.zeros(1, 2, 28, 28, 3)], 1),
    "video 6-D whole": ("video", u8(1, 1, 2, 28, 28, 3), 1),
    "image [5-D array]": ("image", [u8(1, 2, 28, 28, 3)], 1),
    "image [3-D, 5-D tensor]": ("image", [u8(28, 28, 3), torch.zeros(1, 2, 28, 28, 3)], 2),
    "image 6-D whole": ("image", u8(1, 1, 2, 28, 28, 3), 1),
    "audio [3-D array]": ("audio", [f32(1, 2, 1600)], 1),
    "audio [1-D, 3-D tensor]": ("audio", [f32(1600), torch.zeros(1, 2, 1600)], 2),
    "audio 4-D whole": ("audio", f32(1, 1, 2, 1600), 1),
    "audio [(3-D array, 16000)]": ("audio", [(f32(1, 2, 1600), 16000)], 1),
    "audio [(3-D tensor, 16000)]": ("audio", [(torch.zeros(1, 2, 1600), 16000)], 1),
    # A first item of 2-D tensor makes the list embeddings, each a 2-D tensor (helper-83).
    "image [2-D tensor, 3-D array]": ("image", [torch.zeros(4, 8), u8(28, 28, 3)], 2),
    "video [2-D tensor, 4-D array]": ("video", [torch.zeros(4, 8), u8(2, 28, 28, 3)], 2),
    "audio [2-D tensor, 1-D array]": ("audio", [torch.zeros(4, 8), f32(1600)], 2),
}

KEPT: dict[str, tuple[str, Any, int]] = {
    "video (3-D array, meta): one frame": ("video", [(u8(28, 28, 3), META)], 1),
    "video (4-D array, meta)": ("video", [(u8(2, 28, 28, 3), META)], 1),
    "video (3-D tensor, meta)": ("video", [(torch.zeros(28, 28, 3), META)], 1),
    "video (4-D tensor, meta)": ("video", [(torch.zeros(2, 28, 28, 3), META)], 1),
    "video 5-D whole": ("video", u8(2, 2, 28, 28, 3), 2),
    "image [4-D array]": ("image", [u8(2, 28, 28, 3)], 1),
    "image 5-D whole": ("image", u8(2, 2, 28, 28, 3), 2),
    "audio [2-D array]": ("audio", [f32(2, 1600)], 1),
    "audio [(2-D tensor, 16000)]": ("audio", [(torch.zeros(2, 1600), 16000)], 1),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_vllm_refuses_what_records_refuse_for_its_dimensions(
    name: str, tiny_models: dict[str, TinyModel], uncached_renderer: Any, fresh_renderer: Any
) -> None:
    import _tiny_models as tm

    modality, value, items = REFUSED[name]
    model = _model(modality)
    prompt = {"prompt": tiny_models[model].prompt(**{modality: items}), "multi_modal_data": {modality: value}}
    with pytest.raises(PromptTypeError):
        TextPrompt(**prompt)  # type: ignore[arg-type]
    for renderer in (uncached_renderer(model), fresh_renderer(model)):
        with pytest.raises(Exception):  # noqa: B017 - vLLM fails with several types, naming no field
            through_boundary(renderer, tm.build_input_processor(renderer), prompt)


@pytest.mark.parametrize("name", list(KEPT))
def test_vllm_takes_what_records_keep_for_its_dimensions(
    name: str, tiny_models: dict[str, TinyModel], fresh_renderer: Any
) -> None:
    import _tiny_models as tm

    modality, value, items = KEPT[name]
    model = _model(modality)
    record = TextPrompt(
        prompt=tiny_models[model].prompt(**{modality: items}), multi_modal_data={modality: value}
    )
    assert len(record.multi_modal_data[modality]) == items
    renderer = fresh_renderer(model)
    result = through_boundary(renderer, tm.build_input_processor(renderer), to_vllm(record))
    assert len(result["mm_hashes"][modality]) == items
