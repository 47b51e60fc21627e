"""The boundary: engine code hands records to ``RecordInputProcessor``; vLLM gets dicts there only.

``process_inputs`` returns vLLM's own ``EngineCoreRequest``, whose ``mm_features`` carry
the record's keys: its user UUIDs, its content keys, and the replica scope.
"""

from __future__ import annotations

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import subprocess
import sys
import textwrap
from typing import Any

import _tiny_models as tm
import numpy as np
from _tiny_models import TinyModel
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest

from omni_requests import MediaHasher, PromptTypeError, TextPrompt, TokensPrompt, scope_to_replica
from omni_requests_vllm import RecordInputProcessor, to_vllm

pytestmark = pytest.mark.vllm

GENERATE = ("generate",)


def _video(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (28, 28, 3), dtype=np.uint8)


@pytest.fixture
def processor(qwen2_vl: TinyModel, fresh_renderer: Any) -> RecordInputProcessor:
    return RecordInputProcessor(tm.build_input_processor(fresh_renderer("qwen2_vl")))


def _keys_by_modality(request: EngineCoreRequest) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for feature in request.mm_features or []:
        assert feature.identifier == feature.mm_hash  # no LoRA: the identifier is the key
        keys.setdefault(feature.modality, []).append(feature.mm_hash)
    return keys


def test_a_scoped_record_becomes_an_engine_request_carrying_its_keys(
    processor: RecordInputProcessor, qwen2_vl: TinyModel
) -> None:
    hasher = MediaHasher(qwen2_vl.model_id)
    record = TextPrompt(
        prompt=qwen2_vl.prompt(image=2, video=1),
        multi_modal_data={"image": [_image(1), _image(2)], "video": _video(3)},
        multi_modal_uuids={"image": ["cat-1", None]},
    )
    scoped = scope_to_replica(record, 1, hasher=hasher)

    request = processor.process_inputs("req-1", scoped, SamplingParams(max_tokens=4), GENERATE)

    assert isinstance(request, EngineCoreRequest)
    assert request.request_id == "req-1"
    image_key = hasher.key("image", record.multi_modal_data["image"][1])
    video_key = hasher.key("video", record.multi_modal_data["video"][0])
    assert _keys_by_modality(request) == {
        "image": ["stage0:rep1:cat-1", f"stage0:rep1:{image_key}"],
        "video": [f"stage0:rep1:{video_key}"],
    }
    # The features sit in prompt order, each at its placeholder, each with its tensors.
    positions = [f.mm_position.offset for f in request.mm_features or []]
    assert positions == sorted(positions)
    assert all(f.data is not None for f in request.mm_features or [])


def test_an_unscoped_record_gets_the_keys_vllm_computes_for_its_dict(
    processor: RecordInputProcessor, qwen2_vl: TinyModel
) -> None:
    record = TextPrompt(prompt=qwen2_vl.prompt(video=1), multi_modal_data={"video": _video(5)})
    from_record = processor.process_inputs("a", record, SamplingParams(), GENERATE)
    # vLLM's own processor, on the plain dict a user would write (its deprecated raw path).
    plain = {"prompt": record.prompt, "multi_modal_data": {"video": _video(5)}}
    from_dict = processor.input_processor.process_inputs("b", plain, SamplingParams(), GENERATE)
    assert _keys_by_modality(from_record) == _keys_by_modality(from_dict)
    assert _keys_by_modality(from_record) == {
        "video": [MediaHasher(qwen2_vl.model_id).key("video", record.multi_modal_data["video"][0])]
    }
    assert list(from_record.prompt_token_ids or []) == list(from_dict.prompt_token_ids or [])


def test_the_record_is_converted_once_and_left_as_it_was(
    processor: RecordInputProcessor, qwen2_vl: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import omni_requests_vllm._processor as module

    calls: list[object] = []

    def counting_to_vllm(prompt: Any) -> Any:
        calls.append(prompt)
        return to_vllm(prompt)

    monkeypatch.setattr(module, "to_vllm", counting_to_vllm)
    record = scope_to_replica(
        TextPrompt(prompt=qwen2_vl.prompt(image=1), multi_modal_data={"image": _image(7)}),
        0,
        hasher=MediaHasher(qwen2_vl.model_id),
    )
    before = to_vllm(record)
    processor.process_inputs("r", record, SamplingParams(), GENERATE)
    assert calls == [record]
    after = to_vllm(record)
    assert after["multi_modal_uuids"] == before["multi_modal_uuids"]
    assert not after["multi_modal_data"]["image"][0].flags.writeable


def test_text_only_and_token_records_pass_through(processor: RecordInputProcessor) -> None:
    text = processor.process_inputs("t", TextPrompt(prompt="hello world"), SamplingParams(), GENERATE)
    tokens = processor.process_inputs(
        "k", TokensPrompt(prompt_token_ids=list(text.prompt_token_ids or [])), SamplingParams(), GENERATE
    )
    assert text.mm_features is None and tokens.mm_features is None
    assert list(tokens.prompt_token_ids or []) == list(text.prompt_token_ids or [])


def test_it_takes_records_only(processor: RecordInputProcessor) -> None:
    with pytest.raises(PromptTypeError, match="must be a prompt record"):
        processor.process_inputs("x", {"prompt": "hi"}, SamplingParams(), GENERATE)  # type: ignore[arg-type]


def test_vllm_still_refuses_what_the_model_cannot_take(processor: RecordInputProcessor) -> None:
    # Model-dependent checks (here: Qwen2-VL takes no audio) stay vLLM's, at the boundary.
    record = TextPrompt(prompt="what", multi_modal_data={"audio": np.zeros(1600, np.float32)})
    with pytest.raises(Exception, match="audio"):
        processor.process_inputs("x", record, SamplingParams(), GENERATE)


def test_from_config_builds_vllms_input_processor(qwen2_vl: TinyModel) -> None:
    config = tm.build_vllm_config(qwen2_vl.folder)
    processor = RecordInputProcessor.from_config(config)
    record = TextPrompt(prompt=qwen2_vl.prompt(image=1), multi_modal_data={"image": _image(9)})
    request = processor.process_inputs("c", record, SamplingParams(), GENERATE)
    assert [f.modality for f in request.mm_features or []] == ["image"]


def test_importing_the_adapter_does_not_import_vllm() -> None:
    code = textwrap.dedent(
        """
        import sys
        import omni_requests_vllm
        assert "vllm" not in sys.modules, "importing omni_requests_vllm imported vllm"
        assert "RecordInputProcessor" in omni_requests_vllm.__all__
        cls = omni_requests_vllm.RecordInputProcessor
        assert cls.__name__ == "RecordInputProcessor"
        assert "vllm" not in sys.modules, "resolving the wrapper class imported vllm"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
