"""Each caller container is read once: the checks and the freezing read the same snapshot,
and what a container's (or an image's, tensor's or array's) own code raises is refused
by name.

A tuple or list subclass can say one thing to ``len()`` and ``[i]`` and iterate another,
or iterate differently each time; a record keeps exactly what its checks read. Values are
real arrays, tensors and images; only the containers (and subclasses) lie or raise.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_requests import (
    EmbedsPrompt,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
)
from omni_requests_vllm import from_vllm, to_vllm

WAVE = np.linspace(-1, 1, 100, dtype=np.float32)
FRAME = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)


class Boom(Exception):
    """What a caller's own code raises: never one of ours."""


# -- F1: one read, checked and frozen --


class LyingPair(tuple[Any, ...]):
    """``len()`` and ``[i]`` say ``(WAVE, 16000)``; iterating gives what it holds."""

    def __getitem__(self, i: Any) -> Any:
        return (WAVE, 16000)[i]

    def __len__(self) -> int:
        return 2


class TwoFaced(list[Any]):
    """Its first iteration gives ``first``; every later one gives ``later``."""

    def __init__(self, first: list[Any], later: list[Any]) -> None:
        super().__init__(first)
        self.first, self.later, self.reads = first, later, 0

    def __iter__(self) -> Iterator[Any]:
        self.reads += 1
        return iter(self.first if self.reads == 1 else self.later)


def test_an_audio_pair_whose_len_and_index_lie_is_checked_as_it_iterates() -> None:
    # Before: the checks read [0] and [1] (a good waveform and rate), the record kept
    # ('hello', nan), which its own to_vllm dict then failed to rebuild from.
    with pytest.raises(PromptTypeError, match="a str is not a waveform") as caught:
        TextPrompt(prompt="x", multi_modal_data={"audio": [LyingPair(("hello", math.nan))]})
    assert caught.value.path == "$.multi_modal_data.audio[0]"


def test_a_three_tuple_whose_len_says_two_is_refused_as_a_three_tuple() -> None:
    with pytest.raises(PromptTypeError, match="a tuple of 3 is not an audio item") as caught:
        TextPrompt(prompt="x", multi_modal_data={"audio": [LyingPair((WAVE, 16000, "extra"))]})
    assert caught.value.path == "$.multi_modal_data.audio[0]"


def test_a_video_pair_whose_index_lies_is_checked_as_it_iterates() -> None:
    class LyingVideo(tuple[Any, ...]):
        def __getitem__(self, i: Any) -> Any:
            return ([FRAME, FRAME], {"fps": 1.0})[i]

        def __len__(self) -> int:
            return 2

    with pytest.raises(PromptTypeError, match=r"2-D numpy\.ndarray is not a video frame") as caught:
        TextPrompt(
            prompt="x",
            multi_modal_data={"video": [LyingVideo(([np.zeros((2, 2), np.uint8)], {"fps": 1.0}))]},
        )
    assert caught.value.path == "$.multi_modal_data.video[0][0][0]"


def _round_trips(record: TextPrompt) -> None:
    assert from_vllm(to_vllm(record)) == record  # the record's own dict is one it accepts


def test_video_frames_that_iterate_differently_are_kept_as_checked() -> None:
    frames = TwoFaced([FRAME, FRAME], [np.zeros(3, np.uint8), "str"])
    record = TextPrompt(prompt="x", multi_modal_data={"video": [frames]})
    assert frames.reads == 1
    assert record == TextPrompt(prompt="x", multi_modal_data={"video": [[FRAME, FRAME]]})
    _round_trips(record)


def test_video_frames_of_a_pair_that_iterate_differently_are_kept_as_checked() -> None:
    frames = TwoFaced([FRAME, FRAME], [np.zeros(3, np.uint8), "str"])
    record = TextPrompt(prompt="x", multi_modal_data={"video": [(frames, {"fps": 2.0})]})
    assert record == TextPrompt(prompt="x", multi_modal_data={"video": [([FRAME, FRAME], {"fps": 2.0})]})
    _round_trips(record)


def test_a_waveform_list_that_iterates_differently_is_kept_as_checked() -> None:
    samples = TwoFaced([0.1, 0.2, 0.3], ["a", {"b": 1}])
    record = TextPrompt(prompt="x", multi_modal_data={"audio": [(samples, 16000)]})
    assert record == TextPrompt(prompt="x", multi_modal_data={"audio": [([0.1, 0.2, 0.3], 16000)]})
    _round_trips(record)


def test_channels_that_iterate_differently_are_kept_as_checked() -> None:
    left, right = TwoFaced([0.1, 0.2], ["a"]), TwoFaced([0.3, 0.4], [None, None, None])
    record = TextPrompt(prompt="x", multi_modal_data={"audio": [[left, right]]})
    assert record == TextPrompt(prompt="x", multi_modal_data={"audio": [[[0.1, 0.2], [0.3, 0.4]]]})
    _round_trips(record)


def test_a_whole_value_whose_first_element_lies_is_split_as_it_iterates() -> None:
    class FirstLies(list[Any]):
        def __getitem__(self, i: Any) -> Any:
            return 0.5 if i == 0 else list.__getitem__(self, i)

    # [0] says one waveform of floats; it holds two waveforms: split as iterated, the
    # record's items are the ones its UUIDs count, and its dict rebuilds it.
    record = TextPrompt(prompt="x", multi_modal_data={"audio": FirstLies([WAVE, WAVE])})
    assert len(record.multi_modal_data["audio"]) == 2
    assert record == TextPrompt(prompt="x", multi_modal_data={"audio": [WAVE, WAVE]})
    _round_trips(record)


def test_a_whole_value_that_iterates_differently_is_split_once() -> None:
    images = TwoFaced([FRAME, FRAME], ["str"])
    record = TextPrompt(prompt="x", multi_modal_data={"image": images})
    assert images.reads == 1
    assert record == TextPrompt(prompt="x", multi_modal_data={"image": [FRAME, FRAME]})


def test_field_lists_that_iterate_differently_are_kept_as_checked() -> None:
    embeds = torch.zeros(3, 4)
    record = TokensPrompt(prompt_token_ids=[1], negative_prompt_embeds=TwoFaced([embeds], ["str"]))
    assert list(record.negative_prompt_embeds) == [embeds]
    flags = EmbedsPrompt(prompt_embeds=embeds, prompt_is_token_ids=TwoFaced([True, False], [1, 2]))
    assert list(flags.prompt_is_token_ids or ()) == [True, False]
    ids = TokensPrompt(prompt_token_ids=TwoFaced([1, 2], [-1]))
    assert list(ids.prompt_token_ids) == [1, 2]
    uuids = TextPrompt(
        prompt="x", multi_modal_data={"image": [FRAME]}, multi_modal_uuids={"image": TwoFaced(["a"], [1])}
    )
    assert list(uuids.multi_modal_uuids["image"]) == ["a"]


def test_plain_items_are_read_as_they_are_and_others_as_plain_copies() -> None:
    # The fast path: a plain tuple or list cannot lie, so it is read as it is (no copy);
    # one holding a subclass is read as a plain copy of what the subclass iterates.
    from omni_requests._records import _read_item  # private: the one read of an item's containers

    pair = (WAVE, 16000)
    assert _read_item("$", pair, 3) is pair
    channels = [[0.1, 0.2], [0.3, 0.4]]
    assert _read_item("$", channels, 3) is channels
    read = _read_item("$", (TwoFaced([0.1], ["a"]), 16000), 3)
    assert read == ([0.1], 16000) and type(read) is tuple and type(read[0]) is list


# -- F5: a container's own code that raises is refused by name --


class RaisingList(list[Any]):
    def __iter__(self) -> Iterator[Any]:
        raise Boom("__iter__")


class RaisingLenTuple(tuple[Any, ...]):
    def __len__(self) -> int:
        raise Boom("__len__")


class RaisingIterTuple(tuple[Any, ...]):
    def __iter__(self) -> Iterator[Any]:
        raise Boom("__iter__")


class RaisingDict(dict[str, Any]):
    def items(self) -> Any:
        raise Boom("items")


def _masked_image() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.masked import masked_tensor

        return masked_tensor(torch.zeros(4, 4, 3), torch.ones(4, 4, 3, dtype=torch.bool))


RAISING: list[tuple[str, Callable[[], object], str]] = [
    (
        "audio whole value",
        lambda: TextPrompt(prompt="x", multi_modal_data={"audio": RaisingList([WAVE])}),
        "$.multi_modal_data.audio",
    ),
    (
        "custom whole value",
        lambda: TextPrompt(prompt="x", multi_modal_data={"custom": RaisingList([FRAME])}),
        "$.multi_modal_data.custom",
    ),
    (
        "audio tuple whole value",
        lambda: TextPrompt(prompt="x", multi_modal_data={"audio": RaisingIterTuple((WAVE, 16000))}),
        "$.multi_modal_data.audio",
    ),
    (
        "audio pair's len",
        lambda: TextPrompt(prompt="x", multi_modal_data={"audio": [RaisingLenTuple((WAVE, 16000))]}),
        "$.multi_modal_data.audio[0]",
    ),
    (
        "video frames",
        lambda: TextPrompt(prompt="x", multi_modal_data={"video": [RaisingList([FRAME])]}),
        "$.multi_modal_data.video[0]",
    ),
    (
        "waveform in a pair",
        lambda: TextPrompt(prompt="x", multi_modal_data={"audio": [(RaisingList([0.1]), 16000)]}),
        "$.multi_modal_data.audio[0][0]",
    ),
    (
        "a list inside a custom item",
        lambda: TextPrompt(prompt="x", multi_modal_data={"custom": [[RaisingList([1])]]}),
        "$.multi_modal_data.custom[0][0]",
    ),
    (
        "multi_modal_data",
        lambda: TextPrompt(prompt="x", multi_modal_data=RaisingDict({"image": FRAME})),
        "$.multi_modal_data",
    ),
    (
        "multi_modal_uuids",
        lambda: TextPrompt(
            prompt="x", multi_modal_data={"image": FRAME}, multi_modal_uuids=RaisingDict({"image": "a"})
        ),
        "$.multi_modal_uuids",
    ),
    (
        "a UUID row",
        lambda: TextPrompt(
            prompt="x", multi_modal_data={"image": FRAME}, multi_modal_uuids={"image": RaisingList(["a"])}
        ),
        "$.multi_modal_uuids.image",
    ),
    (
        "mm_processor_kwargs",
        lambda: TextPrompt(prompt="x", mm_processor_kwargs=RaisingDict({"a": 1})),
        "$.mm_processor_kwargs",
    ),
    (
        "a mapping inside mm_processor_kwargs",
        lambda: TextPrompt(prompt="x", mm_processor_kwargs={"a": RaisingDict({"b": 1})}),
        "$.mm_processor_kwargs.a",
    ),
    (
        "media_io_kwargs",
        lambda: TextPrompt(prompt="x", media_io_kwargs=RaisingDict({"video": {"num_frames": 2}})),
        "$.media_io_kwargs",
    ),
    (
        "additional_information",
        lambda: TextPrompt(prompt="x", additional_information=RaisingDict({"a": 1})),
        "$.additional_information",
    ),
    (
        "video metadata",
        lambda: TextPrompt(
            prompt="x",
            multi_modal_data={"video": [(np.zeros((2, 4, 4, 3), np.uint8), RaisingDict({"fps": 1.0}))]},
        ),
        "$.multi_modal_data.video[0][1]",
    ),
    (
        "prompt_token_ids",
        lambda: TokensPrompt(prompt_token_ids=RaisingList([1, 2])),
        "$.prompt_token_ids",
    ),
    (
        "modalities",
        lambda: TextPrompt(prompt="x", modalities=RaisingList(["image"])),
        "$.modalities",
    ),
    (
        "prompt_is_token_ids",
        lambda: EmbedsPrompt(prompt_embeds=torch.zeros(2, 4), prompt_is_token_ids=RaisingList([True])),
        "$.prompt_is_token_ids",
    ),
    (
        "negative_prompt_embeds",
        lambda: TokensPrompt(prompt_token_ids=[1], negative_prompt_embeds=RaisingList([torch.zeros(2, 4)])),
        "$.negative_prompt_embeds",
    ),
    (
        "replace_media's data",
        lambda: TextPrompt(prompt="x").replace_media(RaisingDict({"image": FRAME})),
        "$.multi_modal_data",
    ),
    (
        "replace_media's UUIDs",
        lambda: TextPrompt(prompt="x").replace_media({"image": FRAME}, RaisingDict({"image": "a"})),
        "$.multi_modal_uuids",
    ),
    (
        "a MaskedTensor as the whole image value",
        lambda: TextPrompt(prompt="x", multi_modal_data={"image": _masked_image()}),
        "$.multi_modal_data.image",
    ),
]


@pytest.mark.parametrize(("call", "path"), [(c, p) for _, c, p in RAISING], ids=[n for n, _, _ in RAISING])
def test_a_container_whose_own_code_raises_is_refused_by_name(call: Callable[[], object], path: str) -> None:
    with pytest.raises(PromptTypeError, match="cannot be") as caught:
        call()
    assert caught.value.path == path
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_token_whose_index_raises_is_refused_by_name() -> None:
    class Token:
        def __index__(self) -> int:
            raise Boom("__index__")

    with pytest.raises(PromptTypeError, match=r"cannot be read as an int \(Boom") as caught:
        TokensPrompt(prompt_token_ids=[1, Token()])
    assert caught.value.path == "$.prompt_token_ids[1]"


def test_token_ids_in_an_array_subclass_are_read_as_numpy_holds_them() -> None:
    class Ids(np.ndarray[Any, Any]):
        def __iter__(self) -> Iterator[Any]:
            raise Boom("__iter__")

        @property
        def ndim(self) -> int:  # type: ignore[override]
            raise Boom("ndim")

    ids = np.array([3, 1, 4], np.int64).view(Ids)
    assert list(TokensPrompt(prompt_token_ids=ids).prompt_token_ids) == [3, 1, 4]


@pytest.mark.parametrize(
    "call",
    [
        lambda error: TextPrompt(prompt="x", multi_modal_data={"audio": _raising_list(error)([WAVE])}),
        lambda error: TextPrompt(prompt="x", multi_modal_data={"video": [_raising_list(error)([FRAME])]}),
        lambda error: TextPrompt(prompt="x", mm_processor_kwargs=_raising_dict(error)({"a": 1})),
        lambda error: TokensPrompt(prompt_token_ids=_raising_list(error)([1])),
    ],
    ids=["audio", "frames", "options", "token ids"],
)
def test_what_is_no_exception_is_never_caught(call: Callable[[type[BaseException]], object]) -> None:
    # KeyboardInterrupt (and any BaseException that is no Exception) passes unchanged.
    with pytest.raises(KeyboardInterrupt):
        call(KeyboardInterrupt)


def _raising_list(error: type[BaseException]) -> type[list[Any]]:
    class Raising(list[Any]):
        def __iter__(self) -> Iterator[Any]:
            raise error

    return Raising


def _raising_dict(error: type[BaseException]) -> type[dict[str, Any]]:
    class Raising(dict[str, Any]):
        def items(self) -> Any:
            raise error

    return Raising


# -- F6: attributes of image, tensor and array subclasses --


def _image_subclass(attribute: str) -> Image.Image:
    def raising(self: Any) -> Any:
        raise Boom(attribute)

    kind = type(f"Raising_{attribute}", (Image.Image,), {attribute: property(raising)})
    base = Image.new("RGB", (4, 4), (1, 2, 3))
    image = kind.__new__(kind)
    image.__dict__.update({k: v for k, v in base.__dict__.items() if k != attribute})
    return image  # type: ignore[no-any-return]


@pytest.mark.parametrize("attribute", ["mode", "size", "info", "palette"])
@pytest.mark.parametrize(
    ("wrap", "path"),
    [
        (lambda image: {"image": [image]}, "$.multi_modal_data.image[0]"),
        (lambda image: {"image": image}, "$.multi_modal_data.image[0]"),
        (lambda image: {"video": [[image]]}, "$.multi_modal_data.video[0][0]"),
        (lambda image: {"custom": [image]}, "$.multi_modal_data.custom[0]"),
    ],
    ids=["image item", "image whole", "video frame", "custom item"],
)
def test_an_image_whose_attributes_raise_is_refused_by_name(
    attribute: str, wrap: Callable[[Any], Any], path: str
) -> None:
    with pytest.raises(PromptTypeError, match="attributes cannot be read") as caught:
        TextPrompt(prompt="x", multi_modal_data=wrap(_image_subclass(attribute)))
    assert caught.value.path == path


def test_an_image_whose_info_raises_when_read_is_refused_by_name() -> None:
    class Info(dict[str, Any]):
        def __contains__(self, key: object) -> bool:
            raise Boom("__contains__")

    image = Image.new("RGB", (4, 4))
    image.info = Info()
    with pytest.raises(PromptTypeError, match="attributes cannot be read") as caught:
        TextPrompt(prompt="x", multi_modal_data={"image": [image]})
    assert caught.value.path == "$.multi_modal_data.image[0]"


def _tensor_subclass(name: str, *, method: bool) -> type[torch.Tensor]:
    def raising(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise Boom(name)

    return type(f"Raising_{name}", (torch.Tensor,), {name: raising if method else property(raising)})


@pytest.mark.parametrize(
    ("name", "method"), [("dtype", False), ("detach", True), ("cpu", True), ("numpy", True)]
)
@pytest.mark.parametrize("modality", ["image", "audio", "custom"])
def test_a_tensor_whose_own_reads_raise_is_refused_by_name(name: str, method: bool, modality: str) -> None:
    shape = (8,) if modality == "audio" else (4, 4, 3)
    tensor = torch.zeros(*shape).as_subclass(_tensor_subclass(name, method=method))
    with pytest.raises(
        PromptTypeError, match=rf"cannot be read as vLLM's hasher reads it \(Boom: {name}"
    ) as caught:
        TextPrompt(prompt="x", multi_modal_data={modality: [tensor]})
    assert caught.value.path == f"$.multi_modal_data.{modality}[0]"


def test_a_tensor_whose_is_nested_raises_is_read_as_torch_holds_it() -> None:
    # vLLM's parser never reads is_nested; torch's own descriptor tells the record. (A 3-D
    # tensor given whole is a batch of embeddings: one item per row.)
    tensor = torch.zeros(4, 4, 3).as_subclass(_tensor_subclass("is_nested", method=False))
    record = TextPrompt(prompt="x", multi_modal_data={"image": tensor})
    assert len(record.multi_modal_data["image"]) == 4


def test_plain_tensors_vllm_cannot_read_keep_their_refusal() -> None:
    with pytest.raises(PromptTypeError, match="vLLM's hasher cannot read this tensor"):
        TextPrompt(
            prompt="x", multi_modal_data={"image": [torch.zeros(4, 4, 3, dtype=torch.complex64).conj()]}
        )


class RaisingDtype(np.ndarray[Any, Any]):
    @property
    def dtype(self) -> Any:  # type: ignore[override]
        raise Boom("dtype")


class LyingDtype(np.ndarray[Any, Any]):
    @property
    def dtype(self) -> Any:  # type: ignore[override]
        return np.dtype(np.uint8)


def test_an_array_whose_dtype_raises_is_read_as_numpy_holds_it() -> None:
    # The record keeps a plain copy of what numpy holds: the subclass's dtype never matters.
    array = FRAME.view(RaisingDtype)
    record = TextPrompt(prompt="x", multi_modal_data={"custom": [array]}, mm_processor_kwargs={"a": array})
    assert record == TextPrompt(
        prompt="x", multi_modal_data={"custom": [FRAME]}, mm_processor_kwargs={"a": FRAME}
    )
    held = record.mm_processor_kwargs["a"]  # type: ignore[index]
    assert type(held) is np.ndarray and held.dtype == np.uint8


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"custom": "item"}, "dtype object cannot be hashed"),
        ({"image": "item"}, "dtype object holds no pixels"),
        ({"video": "frames"}, "dtype object holds no pixels"),
    ],
)
def test_an_object_array_whose_dtype_says_uint8_is_refused_as_an_object_array(
    data: dict[str, str], match: str
) -> None:
    lying = np.full((4, 4, 3), 7, dtype=object).view(LyingDtype)
    ((modality, how),) = data.items()
    value = [[lying, lying]] if how == "frames" else [lying]
    with pytest.raises(PromptTypeError, match=match):
        TextPrompt(prompt="x", multi_modal_data={modality: value})


def test_an_object_array_whose_dtype_says_uint8_is_an_object_array_in_options() -> None:
    # Options keep object arrays as given (they hold pointers, not bytes to copy); before,
    # numpy's TypeError escaped trying to copy it as uint8.
    lying = np.full((2, 2), 7, dtype=object).view(LyingDtype)
    record = TextPrompt(prompt="x", mm_processor_kwargs={"a": lying})
    assert record.mm_processor_kwargs["a"] is lying  # type: ignore[index]


@pytest.mark.parametrize("which", ["fields", "layout"])
def test_embedding_fields_whose_mappings_raise_are_refused_by_name(which: str) -> None:
    from omni_requests._embedding_fields import EmbeddingFields  # private: made by the chat path

    fields: dict[str, Any] = {"image_embeds": torch.zeros(4, 8), "image_grid_thw": torch.tensor([1, 2, 2])}
    layout: dict[str, Any] = {"image_embeds": "flat", "image_grid_thw": "batched"}
    if which == "fields":
        fields = RaisingDict(fields)
    else:
        layout = RaisingDict(layout)
    with pytest.raises(PromptTypeError, match="entries cannot be read") as caught:
        EmbeddingFields(fields, layout)
    assert caught.value.path == f"$.{which}"
