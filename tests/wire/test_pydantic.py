"""Records as fields of pydantic models: validated by the records' own checks, with a JSON schema."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

pydantic = pytest.importorskip("pydantic")
pydantic_core = pytest.importorskip("pydantic_core")

from omni_requests import (  # noqa: E402
    EncoderDecoderPrompt,
    MediaHasher,
    TextPrompt,
    TokensPrompt,
    scope_to_replica,
)


class Request(pydantic.BaseModel):
    prompt: TextPrompt
    tokens: TokensPrompt | None = None
    pair: EncoderDecoderPrompt | None = None


def test_a_model_takes_records_and_dicts_of_their_fields() -> None:
    image = np.zeros((2, 2, 3), np.uint8)
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    model = Request(prompt=record, tokens={"prompt_token_ids": [1, 2]})
    assert model.prompt is record
    assert model.tokens == TokensPrompt(prompt_token_ids=[1, 2])
    assert model.model_dump()["prompt"] is record


def test_json_bodies_become_records_in_the_callers_order() -> None:
    body = (
        '{"prompt": {"prompt": "<image>", "multi_modal_uuids": {"video": ["v"], "image": ["a", "b"]},'
        ' "mm_processor_kwargs": {"fps": 2}, "cache_salt": "s"},'
        ' "pair": {"encoder_prompt": {"prompt_token_ids": [5]}, "decoder_prompt": {"prompt": "d"}}}'
    )
    model = Request.model_validate_json(body)
    assert model.prompt == TextPrompt(
        prompt="<image>",
        multi_modal_uuids={"video": ["v"], "image": ["a", "b"]},
        mm_processor_kwargs={"fps": 2},
        cache_salt="s",
    )
    assert isinstance(model.pair, EncoderDecoderPrompt)
    assert model.pair.encoder_prompt == TokensPrompt(prompt_token_ids=[5])
    dumped = model.model_dump_json()
    assert '"multi_modal_uuids":{"video":["v"],"image":["a","b"]}' in dumped
    assert Request.model_validate_json(dumped) == model


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ('{"prompt": {"prompt": 5}}', "$.prompt"),
        (
            '{"prompt": {"prompt": "x", "multi_modal_uuids": {"image": ["stage0:rep1:abc"]}}}',
            "$.multi_modal_uuids.image[0]",
        ),
        ('{"prompt": {"prompt": "x", "scope": {"stage_id": 0}}}', "$.scope"),
        ('{"prompt": {"prompt": "x", "multi_modal_data": {"image": [[1]]}}}', "$.multi_modal_data"),
        ('{"prompt": {"prompt": "x", "colour": 1}}', "$.colour"),
        ('{"prompt": {}}', "$"),
        (
            '{"prompt": {"prompt": "x"}, "pair": {"encoder_prompt": {"prompt_token_ids": ["a"]}}}',
            "$.encoder_prompt.prompt_token_ids[0]",
        ),
    ],
)
def test_bad_bodies_are_validation_errors_naming_the_field(body: str, where: str) -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        Request.model_validate_json(body)
    (error,) = caught.value.errors()
    assert error["type"] == "omni_requests"
    assert error["ctx"]["path"] == where


def test_python_validation_runs_the_records_checks() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"\$\.prompt_token_ids\[0\]"):
        Request(prompt={"prompt": "x"}, tokens={"prompt_token_ids": [True]})


def test_json_schema_describes_the_json_fields() -> None:
    schema = Request.model_json_schema()
    text = (
        schema["$defs"]["TextPrompt"]
        if "$defs" in schema and "TextPrompt" in schema["$defs"]
        else schema["properties"]["prompt"]
    )
    assert text["required"] == ["prompt"]
    assert text["additionalProperties"] is False
    assert {"prompt", "multi_modal_uuids", "cache_salt"} <= set(text["properties"])
    assert not {"multi_modal_data", "scope", "prompt_embeds"} & set(text["properties"])


def test_media_and_scopes_are_not_dropped_silently_from_json() -> None:
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)})
    with pytest.raises(pydantic_core.PydanticSerializationError, match="multi_modal_data"):
        Request(prompt=record).model_dump_json()
    scoped = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_uuids={"image": ["u"]}), 1, hasher=MediaHasher("m")
    )
    with pytest.raises(pydantic_core.PydanticSerializationError, match="scope"):
        Request(prompt=scoped).model_dump_json()


@pytest.mark.parametrize(
    ("options", "where", "why"),
    [
        ({"k": b"abc"}, "$.mm_processor_kwargs.k", "bytes has no faithful JSON form"),
        ({"k": float("nan")}, "$.mm_processor_kwargs.k", "nan has no JSON form"),
        ({"k": [1, float("-inf")]}, "$.mm_processor_kwargs.k[1]", "-inf has no JSON form"),
        ({"k": {1, 2}}, "$.mm_processor_kwargs.k", "set has no faithful"),
        ({"k": {"n": np.float32(1.5)}}, "$.mm_processor_kwargs.k.n", "float32 has no faithful"),
        ({"k": np.arange(3)}, "$.mm_processor_kwargs.k", "ndarray has no faithful"),
    ],
)
def test_options_json_cannot_give_back_are_refused_by_name(
    options: dict[str, object], where: str, why: str
) -> None:
    # They used to come back changed (bytes as text, NaN as null, a set as a list) or
    # failed in pydantic with no field named.
    record = TextPrompt(prompt="x", mm_processor_kwargs=options)
    with pytest.raises(
        pydantic_core.PydanticSerializationError, match=f"{re.escape(where)}: .*{re.escape(why)}"
    ):
        Request(prompt=record).model_dump_json()
    pair = EncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="e"), decoder_prompt=record)
    with pytest.raises(
        pydantic_core.PydanticSerializationError, match=re.escape(f"$.decoder_prompt.{where[2:]}: ")
    ):
        Request(prompt=TextPrompt(prompt="x"), pair=pair).model_dump_json()


def test_json_options_round_trip_with_tuples_as_lists() -> None:
    # JSON has one array type: a tuple comes back a list, which vLLM's hasher reads alike.
    record = TextPrompt(prompt="x", mm_processor_kwargs={"size": (2, 3), "a": [1.5, None, True, {"s": "t"}]})
    back = Request.model_validate_json(Request(prompt=record).model_dump_json()).prompt
    assert back == TextPrompt(
        prompt="x", mm_processor_kwargs={"size": [2, 3], "a": [1.5, None, True, {"s": "t"}]}
    )


def test_importing_the_core_does_not_import_pydantic() -> None:
    code = "import sys, omni_requests; assert 'pydantic' not in sys.modules and 'pydantic_core' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
