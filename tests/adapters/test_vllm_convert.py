"""to_vllm / from_vllm without vLLM installed: shapes, round trips and errors.

The same conversions are proven against the real renderer in tests/vllm.
"""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
from PIL import Image

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
    scope_to_replica,
)
from omni_requests_vllm import from_vllm, to_vllm

from ..conftest import numpy_text_beyond_unicode, video


def test_text_prompt_renders_only_the_fields_that_are_set() -> None:
    assert to_vllm(TextPrompt(prompt="hi")) == {"prompt": "hi"}
    assert to_vllm(TokensPrompt(prompt_token_ids=[1, 2], cache_salt="s")) == {
        "prompt_token_ids": [1, 2],
        "cache_salt": "s",
    }


def test_media_become_plain_lists_and_keys_are_rendered(hasher: MediaHasher) -> None:
    frames = video(1)
    p = TextPrompt(
        prompt="<video>",
        multi_modal_data={"video": (frames, {"fps": 2.0, "frames_indices": [0, 1, 2]})},
        mm_processor_kwargs={"size": {"shortest_edge": 8}},
    )
    out = to_vllm(scope_to_replica(p, 1, hasher=hasher))
    item = out["multi_modal_data"]["video"][0]
    assert type(item) is tuple and type(item[1]) is dict and type(item[1]["frames_indices"]) is list
    assert np.array_equal(item[0], frames) and not np.shares_memory(item[0], frames)
    assert out["mm_processor_kwargs"] == {"size": {"shortest_edge": 8}}
    assert type(out["mm_processor_kwargs"]["size"]) is dict
    # The base is the content key, not vLLM's: the metadata's numbers are hashed typed.
    assert out["multi_modal_uuids"] == {
        "video": [f"stage0:rep1:{hasher.content_key('video', p.multi_modal_data['video'][0])}"]
    }


def test_the_engine_may_change_the_dict_without_reaching_the_record(hasher: MediaHasher) -> None:
    p = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_data={"video": video(1)}, additional_information={"ids": [1]}),
        0,
        hasher=hasher,
    )
    before = copy.deepcopy(p)
    out = to_vllm(p)
    out["multi_modal_uuids"]["video"][0] = "stage0:rep1:stage0:rep0:stale"
    out["multi_modal_data"]["video"].append(video(2))
    out["additional_information"]["global_request_id"] = "r-1"
    out["additional_information"]["ids"].append(2)
    assert p == before
    assert to_vllm(p)["additional_information"] == {"ids": [1]}


def test_round_trip_through_dicts() -> None:
    d = {
        "prompt_token_ids": [5, 6, 7],
        "prompt": "a b c",
        "multi_modal_data": {"image": [np.zeros((2, 2, 3), np.uint8), None]},
        "multi_modal_uuids": {"image": [None, "cached"]},
        "media_io_kwargs": {"image": {"mode": "RGB"}},
        "cache_salt": "tenant-a",
    }
    record = from_vllm(d)
    assert isinstance(record, TokensPrompt)
    out = to_vllm(record)
    assert {k: v for k, v in out.items() if k != "multi_modal_data"} == {
        k: v for k, v in d.items() if k != "multi_modal_data"
    }
    image, none = out["multi_modal_data"]["image"]
    assert np.array_equal(image, d["multi_modal_data"]["image"][0]) and none is None  # type: ignore[index]
    assert from_vllm(out) == record


def test_str_and_token_list_prompts() -> None:
    assert from_vllm("hello") == TextPrompt(prompt="hello")
    assert from_vllm([1, 2]) == TokensPrompt(prompt_token_ids=[1, 2])


def test_encoder_decoder_round_trip() -> None:
    d = {"encoder_prompt": {"prompt": "x"}, "decoder_prompt": {"prompt_token_ids": [1]}}
    record = from_vllm(d)
    assert isinstance(record, EncoderDecoderPrompt)
    assert to_vllm(record) == d


def test_from_vllm_does_not_change_its_input() -> None:
    d = {"prompt": "x", "multi_modal_data": {"video": [video(1)]}, "multi_modal_uuids": {"video": "v"}}
    before = copy.deepcopy(d)
    from_vllm(d)
    assert pickle.dumps(d) == pickle.dumps(before)


@pytest.mark.parametrize(
    ("prompt", "error", "path"),
    [
        ({"prompt": "x", "colour": "red"}, InvalidPromptError, "$.colour"),
        ({"multi_modal_data": {}}, InvalidPromptError, "$"),
        ({"prompt": 3}, PromptTypeError, "$.prompt"),
        (3.5, PromptTypeError, "$"),
        ({"encoder_prompt": {"prompt": "x", "bad": 1}}, InvalidPromptError, "$.encoder_prompt.bad"),
        (
            {
                "encoder_prompt": {
                    "prompt": "x",
                    "multi_modal_uuids": {"image": [1]},
                    "multi_modal_data": {"image": [None]},
                }
            },
            PromptTypeError,
            "$.encoder_prompt.multi_modal_uuids.image[0]",
        ),
        ({"encoder_prompt": "x", "extra": 1}, InvalidPromptError, "$.extra"),
        ({"encoder_prompt": "x", 1: 2, "a": 3}, PromptTypeError, "$"),  # sorted() raised TypeError
        ({"encoder_prompt": {"prompt": "x", 1: 2}}, PromptTypeError, "$.encoder_prompt"),
        (
            {
                "prompt": "x",
                "multi_modal_data": {"video": [video(1)]},
                "multi_modal_uuids": {"video": ["stage0:rep0:abc"]},
            },
            InvalidPromptError,
            "$.multi_modal_uuids.video[0]",
        ),
    ],
)
def test_bad_dicts_name_the_field(prompt: object, error: type[Exception], path: str) -> None:
    with pytest.raises(error) as caught:
        from_vllm(prompt)
    assert caught.value.path == path  # type: ignore[attr-defined]


class _Pushy(str):
    """A key that claims to equal every field."""

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        return True


class _Apart(str):
    """A key that hashes apart from its text."""

    def __hash__(self) -> int:
        return str.__hash__(self) + 1


def test_a_str_subclass_key_is_read_as_its_text() -> None:
    # Its own == matched a field it does not spell: TypeError "multiple values for
    # argument 'prompt'" escaped (found by an adversarial review).
    assert from_vllm({_Pushy("prompt"): "x"}) == TextPrompt(prompt="x")
    with pytest.raises(InvalidPromptError) as caught:
        from_vllm({_Pushy("colour"): "x", "prompt": "y"})
    assert caught.value.path == "$.colour"
    with pytest.raises(InvalidPromptError, match="given twice") as caught:
        from_vllm({_Apart("prompt"): "x", "prompt": "y"})  # two entries, one field
    assert caught.value.path == "$.prompt"


@pytest.mark.parametrize(
    "key", ["a\ud800", str(numpy_text_beyond_unicode("abc")[0])], ids=["surrogate", "beyond-unicode"]
)
def test_an_error_naming_a_key_utf8_cannot_carry_still_prints(key: str) -> None:
    # The path keeps the key as given; the message escapes it, so printing or logging
    # the error cannot itself fail with a UnicodeEncodeError.
    with pytest.raises(InvalidPromptError) as caught:
        from_vllm({"prompt": "x", key: 1})
    assert caught.value.path == f"$.{key}"
    text = str(caught.value)
    assert text.encode("utf-8").decode("utf-8") == text and "unknown field" in text


def test_a_rendered_input_is_refused_as_one() -> None:
    # A dict with a "type" is what vLLM's renderer made (keyed by its mm_hashes): the
    # error says so, instead of calling "type" an unknown field of a prompt.
    rendered = {"type": "token", "prompt_token_ids": [1, 2]}
    with pytest.raises(InvalidPromptError, match=r"already rendered.*prompt it was rendered from") as caught:
        from_vllm(rendered)  # type: ignore[call-overload]
    assert caught.value.path == "$.type" and rendered == {"type": "token", "prompt_token_ids": [1, 2]}


def test_to_vllm_refuses_non_records() -> None:
    with pytest.raises(PromptTypeError):
        to_vllm({"prompt": "x"})  # type: ignore[call-overload]


def test_repeated_conversions_hand_out_new_containers(hasher: MediaHasher) -> None:
    # Values that go out as they are (arrays, strings) are laid out once per template;
    # the dict, lists and maps around them must still be new every call.
    images = [np.zeros((2, 2, 3), np.uint8), np.ones((2, 2, 3), np.uint8)]
    template = TextPrompt(
        prompt="<image><image>",
        multi_modal_data={"image": images},
        multi_modal_uuids={"image": ["a", "b"]},
        cache_salt="salt",
    )
    first = to_vllm(scope_to_replica(template, 0, hasher=hasher))
    first["multi_modal_data"]["image"].append(images[0])
    first["multi_modal_data"]["video"] = []
    first["multi_modal_uuids"]["image"][0] = "stage0:rep1:stage0:rep0:a"
    first["cache_salt"] = "other"
    second = to_vllm(scope_to_replica(template, 0, hasher=hasher))
    assert second["multi_modal_uuids"] == {"image": ["stage0:rep0:a", "stage0:rep0:b"]}
    assert len(second["multi_modal_data"]["image"]) == 2 and list(second["multi_modal_data"]) == ["image"]
    assert second["cache_salt"] == "salt" and second["prompt"] == "<image><image>"
    assert to_vllm(scope_to_replica(template, 1, hasher=hasher))["multi_modal_uuids"] == {
        "image": ["stage0:rep1:a", "stage0:rep1:b"]
    }


def test_dicts_keep_the_callers_modality_order(hasher: MediaHasher) -> None:
    names = ["video", "image", "audio", "a", "z"]
    d = {
        "prompt": "x",
        "multi_modal_data": {name: [None] for name in names},
        "multi_modal_uuids": {name: [f"{name}-1"] for name in reversed(names)},
    }
    out = to_vllm(from_vllm(d))
    assert list(out["multi_modal_data"]) == names and list(out["multi_modal_uuids"]) == names[::-1]
    scoped = to_vllm(scope_to_replica(from_vllm(d), 0, hasher=hasher))
    assert list(scoped["multi_modal_uuids"]) == names


def test_a_subclass_of_a_record_converts_as_its_kind() -> None:
    @attrs.frozen(kw_only=True)
    class Tagged(TextPrompt):
        tag: str = "t"

    assert to_vllm(Tagged(prompt="hi", cache_salt="s")) == {"prompt": "hi", "cache_salt": "s"}


def test_images_and_tensors_go_out_as_fresh_hand_outs_of_what_the_record_sealed(hasher: MediaHasher) -> None:
    torch = pytest.importorskip("torch")
    image, embeds = Image.new("RGB", (2, 2), (10, 20, 30)), torch.arange(8.0).reshape(2, 4)
    template = TextPrompt(prompt="x", multi_modal_data={"image": image, "audio": [embeds[0]]})
    first, second = (to_vllm(scope_to_replica(template, 0, hasher=hasher)) for _ in range(2))
    images = [out["multi_modal_data"]["image"][0] for out in (first, second)]
    tensors = [out["multi_modal_data"]["audio"][0] for out in (first, second)]
    # Never the caller's object, nor the record's own view, nor one another: each
    # receiver may change its own without reaching the record or the next request.
    shown = (template.multi_modal_data["image"][0], template.multi_modal_data["audio"][0])
    assert len({id(x) for x in (image, *images, shown[0])}) == 4
    assert len({id(x) for x in (embeds, *tensors, shown[1])}) == 4
    assert all(type(x) is not Image.Image and isinstance(x, Image.Image) for x in images)  # SealedImage
    assert all(x.tobytes() == image.tobytes() and x.mode == "RGB" for x in images)
    assert all(type(x) is torch.Tensor and torch.equal(x, embeds[0]) for x in tensors)
    assert first["multi_modal_data"]["image"] is not second["multi_modal_data"]["image"]
    assert first["multi_modal_uuids"] == second["multi_modal_uuids"]


class _HidesItsMedia(dict[str, Any]):
    """A dict whose iteration leaves out multi_modal_data, which [] and .get still read."""

    def __iter__(self) -> Iterator[str]:
        return (key for key in dict.__iter__(self) if key != "multi_modal_data")

    def keys(self) -> Any:
        return list(iter(self))


def test_a_mapping_that_hides_a_field_from_its_keys_is_refused_not_read_without_it() -> None:
    # vLLM reads a prompt's fields by name; the record was built from the keys the
    # mapping listed, so its media were dropped silently (found by an adversarial review).
    hiding = _HidesItsMedia(prompt="<image>", multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)})
    assert hiding.get("multi_modal_data") is not None and "multi_modal_data" not in list(hiding)
    with pytest.raises(
        InvalidPromptError, match=r"\$\.multi_modal_data: is in the prompt .* give a plain dict"
    ):
        from_vllm(hiding)
    # A mapping that lists what it holds reads as the dict it lists.
    plain = {"prompt": "<image>", "multi_modal_data": {"image": np.zeros((2, 2, 3), np.uint8)}}
    assert from_vllm(types.MappingProxyType(plain)) == from_vllm(plain)


def test_a_modality_of_none_with_uuids_is_dropped_by_from_vllm_and_refused_by_records() -> None:
    # docs/design.md: vLLM drops such a modality with its UUIDs (no item, no key), and so
    # does from_vllm; a record built by hand refuses it (a None value is no list of items).
    given = {
        "prompt": "x",
        "multi_modal_data": {"image": None, "video": video(1)},
        "multi_modal_uuids": {"image": ["a"], "video": ["v"]},
    }
    record = from_vllm(given)
    assert to_vllm(record)["multi_modal_uuids"] == {"video": ["v"]} and list(record.multi_modal_data) == [
        "video"
    ]
    with pytest.raises(InvalidPromptError, match="is None") as caught:
        TextPrompt(prompt="x", multi_modal_data={"image": None}, multi_modal_uuids={"image": ["a"]})
    assert caught.value.path == "$.multi_modal_data.image"
    with pytest.raises(InvalidPromptError) as caught:  # without UUIDs from_vllm refuses it too
        from_vllm({"prompt": "x", "multi_modal_data": {"image": None}})
    assert caught.value.path == "$.multi_modal_data.image"
