"""scope_stage0: the engine's stage-0 scenarios, its pass-through cases, and the caller untouched.

The scenarios follow vllm-omni's own tests of its stage-0 scoping
(tests/engine/test_async_omni_engine_input.py): two requests with the same image over a
local pool of two, a distributed pool with a preselected replica, a distributed pool
with no serviceable replica, and a failed preprocessing step.
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import io
import re
import types
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from pyrsistent import pvector

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
    scope_to_replica,
)
from omni_requests_omni import CacheAffinity, RoundRobin, RouteRequest, Stage0Pool, scope_stage0
from omni_requests_vllm import from_vllm, to_vllm

from ._helpers import FirstReadAs, IndexedAs, containers, deep_equal, image_array, uuids_of, video_array

MODEL = "/models/tiny-omni"
HASHER = MediaHasher(MODEL)
PREFIX = re.compile(r"^stage0:rep(\d+):")


def _pool(replicas: Any = 2, select: Any = None, **kwargs: Any) -> Stage0Pool:
    return Stage0Pool(replicas=replicas, select=select or RoundRobin(), **kwargs)


class Recorder:
    """A selection callable that records what it was asked and answers from a script."""

    def __init__(self, *answers: int | None) -> None:
        self.answers = list(answers)
        self.seen: list[RouteRequest] = []

    def __call__(self, request: RouteRequest) -> int | None:
        self.seen.append(request)
        return self.answers.pop(0)


def _image_prompt(seed: int = 1, **extra: Any) -> dict[str, Any]:
    return {"prompt": "<image> describe", "multi_modal_data": {"image": image_array(seed)}, **extra}


# -- the engine's scenarios ------------------------------------------------------------------


def test_two_requests_with_the_same_image_over_a_local_pool_of_two() -> None:
    pool = _pool(2, RoundRobin())
    seen = []
    for request_id in ("req-1", "req-2"):
        replica, prompt = scope_stage0(_image_prompt(), pool=pool, hasher=HASHER, request_id=request_id)
        seen.append((replica, prompt["multi_modal_uuids"]["image"][0]))
    (r0, k0), (r1, k1) = seen
    assert (r0, r1) == (0, 1)
    assert k0.startswith("stage0:rep0:") and k1.startswith("stage0:rep1:")
    assert (
        k0.removeprefix("stage0:rep0:")
        == k1.removeprefix("stage0:rep1:")
        == HASHER.key("image", image_array(1))
    )


def test_a_distributed_pool_scopes_to_the_replica_it_preselected() -> None:
    bindings: dict[str, int] = {}

    def preselect(request: RouteRequest) -> int:  # binds the request, as a distributed pool does
        bindings[request.request_id or ""] = replica = len(bindings) % 2
        return replica

    pool = _pool([0, 1], preselect)
    keys = [
        scope_stage0(_image_prompt(), pool=pool, hasher=HASHER, request_id=r)[1]["multi_modal_uuids"][
            "image"
        ][0]
        for r in ("req-1", "req-2")
    ]
    assert bindings == {"req-1": 0, "req-2": 1}
    assert keys[0].startswith("stage0:rep0:") and keys[1].startswith("stage0:rep1:")


def test_no_serviceable_replica_yet_passes_the_prompt_through_unscoped() -> None:
    prompt = _image_prompt()
    select = Recorder(None)
    replica, out = scope_stage0(prompt, pool=_pool(2, select), hasher=HASHER, request_id="req-none")
    assert replica is None
    # select is the caller's code, run after the checks: the dict goes on as it was read.
    assert out is not prompt and type(out) is dict and out["prompt"] == prompt["prompt"]
    assert [
        np.array_equal(image, prompt["multi_modal_data"]["image"])
        for image in out["multi_modal_data"]["image"]
    ] == [True]
    assert "multi_modal_uuids" not in out
    assert [r.request_id for r in select.seen] == ["req-none"]


def test_a_bad_prompt_raises_before_a_replica_is_bound() -> None:
    select = Recorder(0)
    bad = _image_prompt(multi_modal_uuids={"image": ["a", "b"]})
    with pytest.raises(InvalidPromptError, match=r"^\$\[1\]\.multi_modal_uuids\.image: .*got 2 vs 1"):
        scope_stage0([_image_prompt(), bad], pool=_pool(2, select), hasher=HASHER)
    assert select.seen == []  # nothing to release: preprocessing never started


def _truncated_png() -> Image.Image:
    data = io.BytesIO()
    Image.fromarray(image_array(3)).save(data, "PNG")
    return Image.open(io.BytesIO(data.getvalue()[: len(data.getvalue()) // 2]))  # decoded lazily


def _transparency_pillow_refuses() -> Image.Image:
    image = Image.fromarray(image_array(4)[:, :, 0], "L")
    image.info["transparency"] = 5.0  # vLLM's parser (Pillow's convert) raises TypeError on it
    return image


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (_truncated_png, "the image cannot be read .*truncated"),
        (_transparency_pillow_refuses, "vLLM's image parser cannot turn this L image into RGB .*TypeError"),
    ],
    ids=["truncated file", "bad transparency"],
)
@pytest.mark.parametrize("policy", ["round robin", "affinity"])
def test_an_item_that_cannot_be_keyed_raises_by_name_before_a_replica_is_bound(
    item: Any, message: str, policy: str
) -> None:
    # An image vLLM could not read or parse: refused by name (decoding fails, or its
    # transparency cannot be applied). A binding policy (vllm-omni's local pool binds in
    # select) must never be asked for such a request.
    asked: list[RouteRequest] = []
    chooser = RoundRobin() if policy == "round robin" else CacheAffinity()
    bad = {"prompt": "<image> <image>", "multi_modal_data": {"image": [image_array(1), item()]}}
    with pytest.raises(InvalidPromptError, match=r"^\$\[1\]\.multi_modal_data\.image\[1\]: " + message):
        scope_stage0(
            [_image_prompt(), bad],
            pool=_pool(2, lambda request: asked.append(request) or chooser(request)),
            hasher=HASHER,
        )
    assert asked == []


def _scoped_pair(decoder_policy: KeyPolicy | None, decoder: Any) -> EncoderDecoderPrompt:
    encoder = scope_to_replica(
        TextPrompt(
            prompt="<image>", multi_modal_data={"image": image_array(1)}, multi_modal_uuids={"image": "a"}
        ),
        0,
        hasher=HASHER,
        policy=KeyPolicy(tenant="acme", bind_content=decoder_policy is None),
    )
    if decoder_policy is not None:
        decoder = scope_to_replica(decoder, 0, hasher=HASHER, policy=decoder_policy)
    return EncoderDecoderPrompt(encoder_prompt=encoder, decoder_prompt=decoder)


@pytest.mark.parametrize(
    ("make", "path"),
    [
        (  # each part scoped under another tenant's policy
            lambda: _scoped_pair(
                KeyPolicy(tenant="other"),
                TextPrompt(
                    prompt="<image>",
                    multi_modal_data={"image": image_array(2)},
                    multi_modal_uuids={"image": "b"},
                ),
            ),
            "$[1].policy",
        ),
        (  # the encoder's bind_content over a decoder item that is cached only
            lambda: _scoped_pair(
                None,
                TextPrompt(
                    prompt="<image>", multi_modal_data={"image": [None]}, multi_modal_uuids={"image": ["c"]}
                ),
            ),
            "$[1].decoder_prompt.multi_modal_data.image[0]",
        ),
    ],
    ids=["two policies", "binding a cached-only item"],
)
def test_an_encoder_decoder_pair_that_cannot_be_scoped_raises_before_a_replica_is_bound(
    make: Any, path: str
) -> None:
    # The pair's checks ran only when it was scoped, after select had bound a replica
    # (vllm-omni's local pool releases a binding only when process_inputs raises).
    asked: list[RouteRequest] = []
    with pytest.raises(InvalidPromptError) as caught:
        scope_stage0(
            [_image_prompt(), make()],
            pool=_pool(2, lambda request: asked.append(request) or 1),
            hasher=HASHER,
            request_id="r",
        )
    assert caught.value.path == path
    assert asked == []


@pytest.mark.parametrize("data", ["array", "tensor"])
def test_an_array_or_tensor_as_the_whole_multi_modal_data_is_refused_by_name(data: str) -> None:
    # Its truth value is ambiguous (numpy and torch raise); read as media, conversion
    # refuses it with our error instead of numpy's ValueError or torch's RuntimeError.
    value: Any = video_array(1)
    if data == "tensor":
        value = pytest.importorskip("torch").from_numpy(value)
    with pytest.raises(PromptTypeError) as caught:
        scope_stage0({"prompt": "x", "multi_modal_data": value}, pool=_pool(2), hasher=HASHER)
    assert caught.value.path == "$.multi_modal_data"


# -- pass-through cases (design.md §2) -------------------------------------------------------


@pytest.mark.parametrize(
    ("pool", "case"),
    [
        (Stage0Pool(replicas=1, select=lambda _: 0), "one replica"),
        (Stage0Pool(replicas=[3], select=lambda _: 3), "one live replica"),
        (Stage0Pool(replicas=4, select=lambda _: 0, is_diffusion=True), "diffusion stage 0"),
    ],
)
def test_pools_without_a_sender_receiver_split_pass_through(pool: Stage0Pool, case: str) -> None:
    prompt = _image_prompt()
    replica, out = scope_stage0(prompt, pool=pool, hasher=HASHER)
    assert (replica, out) == (None, prompt), case
    assert out is prompt


@pytest.mark.parametrize("replicas", [1, [3]])
def test_a_dict_an_engine_scoped_is_refused_with_one_live_replica_too(replicas: Any) -> None:
    # A copy of a scoped dict given a new video was refused with two replicas and sent as
    # it was with one, so the new video reached the engine under the old one's key, which
    # that replica had cached while it was one of several (found by an adversarial review).
    old, new = video_array(0), video_array(1)
    template = {"prompt": "<video>", "multi_modal_data": {"video": old}}
    _, scoped = scope_stage0(template, pool=_pool(2), hasher=HASHER)
    copied = dict(scoped, multi_modal_data={"video": new})
    one = Stage0Pool(replicas=replicas, select=lambda _: None)
    for prompts, path in (
        (copied, "$.multi_modal_uuids.video[0]"),
        ([{"prompt": "x"}, copied], "$[1].multi_modal_uuids.video[0]"),
        (({"prompt": "x"}, copied), "$[1].multi_modal_uuids.video[0]"),  # vLLM's batch too
        ({"encoder_prompt": "x", "decoder_prompt": copied}, "$.decoder_prompt.multi_modal_uuids.video[0]"),
        (
            dict(copied, multi_modal_uuids={"video": scoped["multi_modal_uuids"]["video"][0]}),
            "$.multi_modal_uuids.video[0]",
        ),
    ):
        with pytest.raises(InvalidPromptError, match="already scoped to a replica") as caught:
            scope_stage0(prompts, pool=one, hasher=HASHER)
        assert caught.value.path == path
    assert scope_stage0(template, pool=one, hasher=HASHER).prompts is template  # unscoped: as before


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_scoped_key_in_any_sequence_vllm_reads_as_a_uuid_row_is_refused(replicas: int) -> None:
    # With one replica only list and tuple rows were read, and vLLM reads any sequence
    # but a str as a row: the old media's scoped key in a deque, a pvector or an array of
    # str reached the engine with new media (found by an adversarial review, helper-59);
    # vLLM indexes a dict keyed 0, 1, ... or a mapping proxy too (helper-60).
    stale = f"stage0:rep0:{HASHER.key('image', image_array(0))}"
    pool = Stage0Pool(replicas=replicas, select=lambda _: 0)
    for row in (
        collections.deque([stale]),
        pvector([stale]),
        collections.UserList([stale]),
        np.array([stale]),
        {0: stale},
        types.MappingProxyType({0: stale}),
    ):
        prompt = {
            "prompt": "<image>",
            "multi_modal_data": {"image": [image_array(1)]},
            "multi_modal_uuids": {"image": row},
        }
        with pytest.raises((InvalidPromptError, PromptTypeError)) as caught:
            scope_stage0(prompt, pool=pool, hasher=HASHER)
        assert caught.value.path.startswith("$.multi_modal_uuids.image"), type(row)
    # A user UUID spelled with other digits than ASCII's was refused as engine-scoped.
    other_digits = {
        "prompt": "<image>",
        "multi_modal_data": {"image": [image_array(1)]},
        "multi_modal_uuids": {"image": ["stage\u0660:rep\u0660:x"]},
    }
    _, out = scope_stage0(other_digits, pool=_pool(2), hasher=HASHER)
    assert out["multi_modal_uuids"]["image"][0].endswith(":stage\u0660:rep\u0660:x")


def test_a_diffusion_prompt_of_any_shape_passes_through_unchecked() -> None:
    custom = {"prompt_ids": [1, 2], "extra_args": {"steps": 4}, "multi_modal_data": {"img2img": object()}}
    pool = Stage0Pool(replicas=2, select=lambda _: 0, is_diffusion=True)
    assert scope_stage0(custom, pool=pool, hasher=HASHER).prompts is custom


@pytest.mark.parametrize(
    "prompts",
    [
        {"prompt": "no media"},
        {"prompt": "empty", "multi_modal_data": {}},
        "just text",
        [1, 2, 3],
        [{"prompt": "a"}, "b", [4, 5]],
        TextPrompt(prompt="record"),
        [],
    ],
    ids=["dict", "empty-media", "str", "token-ids", "list", "record", "empty-list"],
)
def test_prompts_without_media_pass_through_and_select_is_not_asked(prompts: Any) -> None:
    select = Recorder()
    replica, out = scope_stage0(prompts, pool=_pool(2, select), hasher=HASHER)
    assert replica is None and out is prompts
    assert select.seen == []


class EngineRequest:
    """Stands for a request the engine built already (its own type)."""

    multi_modal_data: ClassVar[dict[str, str]] = {"image": "not a prompt"}


def test_an_engine_request_passes_through() -> None:
    request = EngineRequest()
    select = Recorder()
    pool = _pool(2, select, engine_request_types=EngineRequest)
    assert scope_stage0(request, pool=pool, hasher=HASHER) == (None, request)
    assert select.seen == []


@pytest.mark.vllm
def test_a_vllm_engine_core_request_passes_through_without_configuration() -> None:
    engine = pytest.importorskip("vllm.v1.engine")
    params = pytest.importorskip("vllm.sampling_params")
    request = engine.EngineCoreRequest(
        request_id="req-1",
        prompt_token_ids=[1, 1, 1],
        mm_features=None,
        sampling_params=params.SamplingParams(max_tokens=8),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    select = Recorder()
    assert scope_stage0(request, pool=_pool(2, select), hasher=HASHER).prompts is request
    assert select.seen == []


# -- one request, one replica --------------------------------------------------------------


def test_all_prompts_of_a_request_go_to_one_replica_and_select_is_asked_once() -> None:
    select = Recorder(1)
    prompts = [
        _image_prompt(1),
        {
            "prompt": "<video>",
            "multi_modal_data": {"video": video_array(2)},
            "multi_modal_uuids": {"video": "clip"},
        },
        {"prompt": "no media here"},
        "plain text",
        [7, 8, 9],
        TextPrompt(prompt="<image>", multi_modal_data={"image": image_array(3)}),
    ]
    replica, out = scope_stage0(prompts, pool=_pool(3, select), hasher=HASHER, request_id="req-9")
    assert replica == 1 and len(select.seen) == 1
    assert isinstance(out, list) and out is not prompts and len(out) == len(prompts)
    prefixes = {PREFIX.match(k).group(1) for p in out if not isinstance(p, (str, list)) for k in _all_keys(p)}
    assert prefixes == {"1"}
    assert out[1]["multi_modal_uuids"] == {"video": ["stage0:rep1:clip"]}
    assert out[2] == {"prompt": "no media here"} and out[2] is not prompts[2]
    assert out[3] == "plain text"
    assert out[4] == [7, 8, 9] and out[4] is not prompts[4]
    assert isinstance(out[5], TextPrompt) and out[5].scope is not None and out[5].scope.replica_id == 1
    assert select.seen[0].media_keys == (
        HASHER.key("image", image_array(1)),
        "clip",
        HASHER.key("image", image_array(3)),
    )


def test_a_tuple_is_a_batch_as_vllm_reads_it_and_comes_back_a_tuple() -> None:
    # vLLM's prompt_to_seq reads any sequence but a str, bytes, dict or token list as a
    # batch. A tuple was read as one prompt without media and passed through unscoped: a
    # shallow copy of a scoped dict given new media then went out under the old media's key
    # (found by an adversarial review).
    from vllm.renderers.inputs.preprocess import prompt_to_seq

    select = Recorder(1)
    template = {"prompt": "<video>", "multi_modal_data": {"video": video_array(0)}}
    replica, out = scope_stage0((template, "text"), pool=_pool(2, select), hasher=HASHER)
    assert replica == 1 and type(out) is tuple and len(prompt_to_seq(out)) == 2
    assert out[0]["multi_modal_uuids"] == {"video": [f"stage0:rep1:{HASHER.key('video', video_array(0))}"]}
    assert out[1] == "text" and "multi_modal_uuids" not in template  # the caller's dict untouched
    retry = dict(out[0], multi_modal_data={"video": video_array(1)})  # new media, the old scoped key
    with pytest.raises(InvalidPromptError, match="already scoped to a replica") as caught:
        scope_stage0((retry,), pool=_pool(2), hasher=HASHER)
    assert caught.value.path == "$[0].multi_modal_uuids.video[0]"
    assert scope_stage0((1, 2), pool=_pool(2, select), hasher=HASHER).replica_id is None  # vLLM's to refuse
    assert len(select.seen) == 1


def test_a_dicts_images_and_tensors_go_out_as_the_callers_own_objects() -> None:
    # docs/design.md: scope_stage0 reads a dict into records only to route it, so it keeps
    # (never seals or copies) the caller's images and tensors.
    torch = pytest.importorskip("torch")
    image, video = Image.fromarray(image_array(4)), torch.from_numpy(video_array(5))
    given = {"prompt": "<image><video>", "multi_modal_data": {"image": image, "video": video}}
    _, out = scope_stage0(given, pool=_pool(2, Recorder(1)), hasher=HASHER, request_id="r")
    data = out["multi_modal_data"]
    sent_image = data["image"][0] if isinstance(data["image"], list) else data["image"]
    sent_video = data["video"][0] if isinstance(data["video"], list) else data["video"]
    assert sent_image is image and sent_video.data_ptr() == video.data_ptr()


def _all_keys(prompt: Any) -> list[str]:
    return [k for row in uuids_of(prompt).values() for k in row if k is not None]


def test_records_come_back_as_records_of_the_same_kind() -> None:
    record = TokensPrompt(prompt_token_ids=[1, 2], multi_modal_data={"video": video_array(4)})
    replica, out = scope_stage0(record, pool=_pool(2, lambda _: 1), hasher=HASHER)
    assert replica == 1
    assert type(out) is TokensPrompt and out == attrs.evolve(record, scope=out.scope)
    assert out == scope_to_replica(record, 1, hasher=HASHER)


def test_encoder_decoder_prompts_are_scoped_in_both_parts() -> None:
    as_dict = {
        "encoder_prompt": {
            "prompt": "<audio>",
            "multi_modal_data": {"audio": (np.ones(8, np.float32), 16000)},
        },
        "decoder_prompt": {"prompt": "transcript:"},
    }
    _, out = scope_stage0(as_dict, pool=_pool(2, lambda _: 1), hasher=HASHER)
    key = out["encoder_prompt"]["multi_modal_uuids"]["audio"][0]
    assert key == "stage0:rep1:" + HASHER.content_key("audio", (np.ones(8, np.float32), 16000))
    assert "multi_modal_uuids" not in out["decoder_prompt"]
    record = from_vllm(as_dict)
    assert isinstance(record, EncoderDecoderPrompt)
    _, scoped = scope_stage0(record, pool=_pool(2, lambda _: 1), hasher=HASHER)
    assert deep_equal(to_vllm(scoped), out)


# -- keys: user UUIDs, cached-only items, retries, templates ----------------------------------


def test_user_uuids_cached_only_items_and_uuid_only_modalities_are_all_scoped() -> None:
    prompt = {
        "prompt": "<image><image><video>",
        "multi_modal_data": {"image": [image_array(1), None]},
        "multi_modal_uuids": {"image": [None, "cached-cat"], "video": ["cached-clip"]},
    }
    _, out = scope_stage0(prompt, pool=_pool(2, lambda _: 0), hasher=HASHER)
    assert out["multi_modal_uuids"] == {
        "image": ["stage0:rep0:" + HASHER.key("image", image_array(1)), "stage0:rep0:cached-cat"],
        "video": ["stage0:rep0:cached-clip"],
    }


def test_a_retry_on_another_replica_gets_the_key_a_first_time_request_gets_there() -> None:
    prompt = _image_prompt()
    _, first = scope_stage0(prompt, pool=_pool(2, lambda _: 0), hasher=HASHER)
    _, retry = scope_stage0(prompt, pool=_pool(2, lambda _: 1), hasher=HASHER)
    _, fresh = scope_stage0(_image_prompt(), pool=_pool(2, lambda _: 1), hasher=HASHER)
    assert retry["multi_modal_uuids"] == fresh["multi_modal_uuids"]
    assert retry["multi_modal_uuids"]["image"][0] == "stage0:rep1:" + HASHER.key("image", image_array(1))
    assert first["multi_modal_uuids"]["image"][0].startswith("stage0:rep0:")
    # Handing back the engine's own copy is refused, not double-prefixed.
    with pytest.raises(InvalidPromptError, match=r"already scoped to a replica"):
        scope_stage0(first, pool=_pool(2, lambda _: 1), hasher=HASHER)


def test_a_used_template_and_three_copies_with_new_videos_give_four_distinct_keys() -> None:
    """design.md §2: the old engine wrote scoped keys back into the template."""
    template = {"prompt": "<video> what happens?", "multi_modal_data": {"video": video_array(0)}}
    pool = _pool(2, RoundRobin())
    _, used = scope_stage0(template, pool=pool, hasher=HASHER)
    keys = [used["multi_modal_uuids"]["video"][0]]
    for seed in (1, 2, 3):
        copy_ = dict(template)  # a shallow copy, as callers make
        copy_["multi_modal_data"] = {"video": video_array(seed)}
        _, out = scope_stage0(copy_, pool=pool, hasher=HASHER)
        keys.append(out["multi_modal_uuids"]["video"][0])
    assert len(set(keys)) == 4
    assert all(key.count("stage0:") == 1 for key in keys)
    bases = [PREFIX.sub("", key) for key in keys]
    assert bases == [HASHER.key("video", video_array(seed)) for seed in range(4)]
    assert "multi_modal_uuids" not in template


# -- the caller's objects -------------------------------------------------------------------


def test_the_callers_prompts_are_untouched_and_share_nothing_mutable_with_the_result() -> None:
    prompts = [
        _image_prompt(1, multi_modal_uuids={"image": ["cat"]}, mm_processor_kwargs={"size": {"h": 4}}),
        {
            "prompt": "<video>",
            "multi_modal_data": {"video": [video_array(2)]},
            "additional_information": {"a": [1]},
        },
        [1, 2, 3],
    ]
    before = copy.deepcopy(prompts)
    _, out = scope_stage0(prompts, pool=_pool(2, CacheAffinity()), hasher=HASHER)
    assert deep_equal(prompts, before)
    assert not set(containers(out)) & set(containers(prompts))
    out[0]["multi_modal_uuids"]["image"].append("x")
    out[1]["additional_information"]["a"].append(2)
    assert deep_equal(prompts, before)


def test_media_arrays_are_sent_as_immutable_copies() -> None:
    image = image_array(5)
    _, out = scope_stage0(
        {"prompt": "<image>", "multi_modal_data": {"image": image}}, pool=_pool(), hasher=HASHER
    )
    sent = out["multi_modal_data"]["image"][0]
    assert np.array_equal(sent, image) and not np.shares_memory(sent, image)
    with pytest.raises(ValueError, match="WRITEABLE"):
        sent.flags.writeable = True  # whoever receives the dict cannot write behind the key
    assert image.flags.writeable  # the caller's own array keeps its flag


# -- contract errors -----------------------------------------------------------------------


@pytest.mark.parametrize("answer", [2, -1, True, "0", 1.0])
def test_select_must_return_a_live_replica_id(answer: Any) -> None:
    with pytest.raises(InvalidPromptError, match=r"^\$\.pool\.select: returned .* not a live replica id"):
        scope_stage0(_image_prompt(), pool=_pool([0, 1], lambda _: answer), hasher=HASHER)


def test_unknown_prompt_objects_in_a_scoped_request_are_refused() -> None:
    with pytest.raises(PromptTypeError, match=r"^\$\[1\]: must be a prompt dict.*got object"):
        scope_stage0([_image_prompt(), object()], pool=_pool(), hasher=HASHER)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": [0, 0]}, r"\$\.replicas: replica ids must be distinct"),
        ({"replicas": [0, -1]}, r"\$\.replicas\[1\]: must be between 0 and 2\*\*63 - 1, got -1"),
        ({"replicas": "2"}, r"\$\.replicas: must be a replica count"),
        ({"replicas": 2, "select": 3}, r"\$\.select: must be callable"),
        ({"replicas": 2, "engine_request_types": [1]}, r"\$\.engine_request_types\[0\]: must be a type"),
        # bool("false") is True: a pool read from text would stop scoping, silently.
        ({"replicas": 2, "is_diffusion": "false"}, r"\$\.is_diffusion: must be a bool, got str"),
        ({"replicas": 2, "is_diffusion": np.array([1, 0])}, r"\$\.is_diffusion: must be a bool, got numpy"),
        ({"replicas": 2, "is_diffusion": 1}, r"\$\.is_diffusion: must be a bool, got int"),
    ],
)
def test_pool_facts_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((InvalidPromptError, PromptTypeError), match=message):
        Stage0Pool(**{"select": RoundRobin(), **kwargs})


def test_a_numpy_bool_says_whether_stage_0_is_a_diffusion_stage() -> None:
    for flag in (False, True):
        pool = Stage0Pool(replicas=2, select=RoundRobin(), is_diffusion=np.bool_(flag))
        assert pool.is_diffusion is flag


def test_the_hasher_and_pool_arguments_are_checked() -> None:
    with pytest.raises(PromptTypeError, match="hasher: must be a MediaHasher"):
        scope_stage0(_image_prompt(), pool=_pool(), hasher="model")  # type: ignore[arg-type]
    with pytest.raises(PromptTypeError, match="pool: must be a Stage0Pool"):
        scope_stage0(_image_prompt(), pool=object(), hasher=HASHER)  # type: ignore[arg-type]


# -- properties ------------------------------------------------------------------------------

_items = st.one_of(
    st.integers(0, 50).map(image_array),
    st.integers(0, 50).map(lambda seed: video_array(seed, frames=2, side=4)),
)
_uuid = st.one_of(st.none(), st.text("abc-xyz0123", min_size=1, max_size=6))


@st.composite
def _media_prompts(draw: st.DrawFn) -> dict[str, Any]:
    images = draw(st.lists(st.integers(0, 50).map(image_array), min_size=0, max_size=3))
    videos = draw(st.lists(st.integers(0, 50).map(lambda s: video_array(s, frames=2, side=4)), max_size=2))
    prompt: dict[str, Any] = {"prompt": "p", "multi_modal_data": {}}
    uuids: dict[str, list[str | None]] = {}
    for modality, items in (("image", images), ("video", videos)):
        if items:
            prompt["multi_modal_data"][modality] = items
            uuids[modality] = [draw(_uuid) for _ in items]
    if draw(st.booleans()) and uuids:
        prompt["multi_modal_uuids"] = uuids
    return prompt


@settings(max_examples=60, deadline=None)
@given(st.lists(_media_prompts(), min_size=1, max_size=3), st.integers(2, 5), st.data())
def test_dict_results_equal_the_core_scoping_of_the_same_records(
    prompts: list[dict[str, Any]], replicas: int, data: st.DataObject
) -> None:
    chosen = data.draw(st.integers(0, replicas - 1))
    before = copy.deepcopy(prompts)
    refusals = []  # one UUID over two different items (the drawn UUIDs repeat)
    for i, prompt in enumerate(prompts):
        try:
            from_vllm(prompt)
        except InvalidPromptError as refused:
            refusals.append(f"$[{i}]{refused.path[1:]}")
    if refusals:
        with pytest.raises(InvalidPromptError, match="also names") as caught:
            scope_stage0(prompts, pool=_pool(replicas, lambda _: chosen), hasher=HASHER)
        assert caught.value.path == refusals[0]
        assert deep_equal(prompts, before)
        return
    replica, out = scope_stage0(prompts, pool=_pool(replicas, lambda _: chosen), hasher=HASHER)
    assert deep_equal(prompts, before)
    if not any(p["multi_modal_data"] for p in prompts):
        assert replica is None and out is prompts
        return
    assert replica == chosen
    for given_prompt, scoped in zip(prompts, out, strict=True):
        expected = to_vllm(scope_to_replica(from_vllm(given_prompt), chosen, hasher=HASHER))
        assert deep_equal(scoped, expected)
        for key in _all_keys(scoped):
            assert key.count("stage0:") == 1 and key.startswith(f"stage0:rep{chosen}:")


@pytest.mark.parametrize(
    "pool",
    [_pool(1), _pool(2, lambda _: None), _pool(())],
    ids=["one_replica", "none_selected", "no_replica"],
)
def test_a_dict_passed_through_unscoped_may_not_give_one_uuid_to_two_items(pool: Stage0Pool) -> None:
    # Nothing is scoped on these roads, so the dict reaches vLLM as it is: one UUID over
    # two images would be one cache entry there, the second served the first's features.
    image = image_array(1)
    shared = {
        "prompt": "<image><image>",
        "multi_modal_data": {"image": [image, image_array(2)]},
        "multi_modal_uuids": {"image": ["u", "u"]},
    }
    before = copy.deepcopy(shared)
    with pytest.raises(InvalidPromptError, match="UUID 'u' also names") as caught:
        scope_stage0([{"prompt": "x"}, shared], pool=pool, hasher=HASHER)
    assert caught.value.path == "$[1].multi_modal_uuids.image[1]"
    assert deep_equal(shared, before)
    same = {**shared, "multi_modal_data": {"image": [image, image]}}  # one image twice: one item
    sent = scope_stage0(same, pool=pool, hasher=HASHER)[1]
    # Taken, and sent as what the rule compared (vLLM reads the items again), not the caller's.
    assert sent is not same and sent["multi_modal_uuids"] == {"image": ["u", "u"]}
    assert all(np.array_equal(item, image) for item in sent["multi_modal_data"]["image"])

    # A UUID given as a bare str names one item too, here also a video's.
    across = {
        "prompt": "<image><video>",
        "multi_modal_data": {"image": image, "video": video_array(1)},
        "multi_modal_uuids": {"image": "clip", "video": ["clip"]},
    }
    with pytest.raises(InvalidPromptError, match="UUID 'clip' also names") as caught:
        scope_stage0(across, pool=pool, hasher=HASHER)
    assert caught.value.path == "$.multi_modal_uuids.video[0]"

    # UUIDs that are no str vLLM keys as they are ([7, 7]; raw bytes, indexed into ints);
    # a UUID in both parts of a pair names one entry of the one processor cache.
    for row in ([7, 7], b"aa", bytearray(b"aa")):
        with pytest.raises(PromptTypeError) as caught:
            scope_stage0({**shared, "multi_modal_uuids": {"image": row}}, pool=pool, hasher=HASHER)
        assert caught.value.path.startswith("$.multi_modal_uuids.image"), row
    pair = {
        "encoder_prompt": {
            "prompt": "<image>",
            "multi_modal_data": {"image": image},
            "multi_modal_uuids": {"image": "u"},
        },
        "decoder_prompt": {
            "prompt": "<image>",
            "multi_modal_data": {"image": image_array(2)},
            "multi_modal_uuids": {"image": "u"},
        },
    }
    with pytest.raises(InvalidPromptError, match="UUID 'u' also names encoder_prompt") as caught:
        scope_stage0(pair, pool=pool, hasher=HASHER)
    assert caught.value.path == "$.decoder_prompt.multi_modal_uuids.image[0]"


class _Uuid(str):
    """A str subclass: its own ``__eq__`` and ``__hash__`` are what vLLM's cache would use."""


PASSING_POOLS = [_pool(1), _pool(2, lambda _: None), _pool(())]
PASSING_IDS = ["one_replica", "none_selected", "no_replica"]


@pytest.mark.parametrize("pool", PASSING_POOLS, ids=PASSING_IDS)
def test_where_nothing_is_scoped_vllm_is_handed_what_was_checked(pool: Stage0Pool) -> None:
    images = [image_array(1), image_array(2)]
    plain = {
        "prompt": "<image><image>",
        "multi_modal_data": {"image": images},
        "multi_modal_uuids": {"image": ["a", "b"]},
    }
    # Plain dicts and lists are read by vLLM as they are checked: the caller's own goes on,
    # unless select (the caller's code) ran after the checks.
    asked = len(pool.replicas) > 1
    assert (scope_stage0(plain, pool=pool, hasher=HASHER)[1] is plain) is not asked
    batch = (plain, "text", [1, 2])
    sent = scope_stage0(batch, pool=pool, hasher=HASHER)[1]
    assert (sent is batch) is not asked and type(sent) is tuple and sent[1:] == ("text", [1, 2])

    scoped = f"stage0:rep0:{HASHER.key('image', images[1])}"
    for row in (
        IndexedAs(["a", "b"], ["a", "a"]),  # one cache entry for two images
        IndexedAs(["a", "b"], ["a", scoped]),  # an engine-scoped key, hidden from iteration
        (_Uuid("a"), "b"),
        pvector(["a", "b"]),
    ):
        caller = {**plain, "multi_modal_uuids": {"image": row}}
        before = copy.deepcopy(caller)
        for prompt in (caller, types.MappingProxyType(caller)):
            replica, sent = scope_stage0((prompt, "text"), pool=pool, hasher=HASHER)
            assert replica is None and type(sent) is tuple and sent[1] == "text"
            assert type(sent[0]) is dict and type(sent[0]["multi_modal_uuids"]) is dict
            sent_row = sent[0]["multi_modal_uuids"]["image"]
            # As vLLM reads it: len and [i].
            assert type(sent_row) is list and [sent_row[i] for i in range(len(sent_row))] == ["a", "b"], row
            assert all(type(uuid) is str for uuid in sent_row)
            sent_images = sent[0]["multi_modal_data"]["image"]
            assert all(np.array_equal(a, b) for a, b in zip(sent_images, images, strict=True))
        assert deep_equal(caller, before)

    # What the read sees is checked as a record's would be: an engine-scoped UUID, or one
    # UUID over two images, refused by name whatever holds the row.
    for row, refusal in (
        (pvector(["a", scoped]), "already scoped"),
        (IndexedAs(["a", "a"], ["a", "b"]), "UUID 'a' also names"),
        (["a", ""], "must not be empty"),  # plain rows too: what a record refuses in a UUID
        (["a", "tenant:acme:user:cat"], "starts with 'tenant:'"),
        (["a", "bound:x"], "starts with 'bound:'"),
    ):
        with pytest.raises(InvalidPromptError, match=refusal) as caught:
            scope_stage0([plain, {**plain, "multi_modal_uuids": {"image": row}}], pool=pool, hasher=HASHER)
        assert caught.value.path == "$[1].multi_modal_uuids.image[1]"
    # A row no record takes is refused as where stage 0 scopes (on one replica it went on
    # before, to fail once stage 0 had two).
    for row in (collections.deque(["a", "b"]), np.array(["a", "b"])):
        with pytest.raises(PromptTypeError, match="must be a str or a list of str") as caught:
            scope_stage0({**plain, "multi_modal_uuids": {"image": row}}, pool=pool, hasher=HASHER)
        assert caught.value.path == "$.multi_modal_uuids.image"


class _KeyFor(str):
    """A field name whose own ``==`` says no to the first ``hidden`` lookups (the checks'),
    then yes (the engine's)."""

    def __new__(cls, text: str, hidden: int) -> _KeyFor:
        key = super().__new__(cls, text)
        key.hidden = hidden
        return key

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        self.hidden -= 1
        return self.hidden < 0 and str.__eq__(self, other)


class _Batch(list[Any]):
    """A caller's own batch type: its iteration is its own code, run again by each read."""


class _Clips(np.ndarray):
    """Two videos stacked; iterating it (vLLM's read of a video array) gives others."""

    def __iter__(self) -> Iterator[Any]:
        yield video_array(1)
        yield video_array(2)


@pytest.mark.parametrize("pool", PASSING_POOLS, ids=PASSING_IDS)
def test_holders_of_keys_and_batches_that_could_answer_vllm_otherwise_go_on_as_read(pool: Stage0Pool) -> None:
    images = [image_array(1), image_array(2)]
    data = {"image": images}
    # A field name whose == hides the UUIDs from a first lookup: read as a record, whose
    # keys are plain, and refused as one there (one UUID over two images).
    hiding = {
        "prompt": "<image><image>",
        "multi_modal_data": data,
        _KeyFor("multi_modal_uuids", 5): {"image": ["a", "a"]},
    }
    with pytest.raises(InvalidPromptError, match="UUID 'a' also names") as caught:
        scope_stage0(hiding, pool=pool, hasher=HASHER)
    assert caught.value.path == "$.multi_modal_uuids.image[1]"

    # A UUID map that is no plain dict goes on as the plain dict that was read.
    proxied = {
        "prompt": "<image><image>",
        "multi_modal_data": data,
        "multi_modal_uuids": types.MappingProxyType({"image": ["a", "b"]}),
    }
    sent = scope_stage0(proxied, pool=pool, hasher=HASHER)[1]
    assert type(sent["multi_modal_uuids"]) is dict and sent["multi_modal_uuids"] == {"image": ["a", "b"]}

    # So does a prompt mapping that is no plain dict, however plain what it holds, and a
    # pair whose part holds its UUIDs in a row of the caller's own type.
    plain = {"prompt": "<image><image>", "multi_modal_data": data, "multi_modal_uuids": {"image": ["a", "b"]}}
    sent = scope_stage0(types.MappingProxyType(plain), pool=pool, hasher=HASHER)[1]
    assert type(sent) is dict and sent["multi_modal_uuids"] == {"image": ["a", "b"]}
    hidden = IndexedAs(["a"], [f"stage0:rep0:{HASHER.key('image', images[0])}"])
    part = {
        "prompt": "<image>",
        "multi_modal_data": {"image": images[0]},
        "multi_modal_uuids": {"image": hidden},
    }
    sent = scope_stage0({"encoder_prompt": part, "decoder_prompt": "b"}, pool=pool, hasher=HASHER)[1]
    row = sent["encoder_prompt"]["multi_modal_uuids"]["image"]
    assert type(row) is list and [row[i] for i in range(len(row))] == ["a"]

    # A batch vLLM would iterate again goes on as the list that was read.
    batch = _Batch([{"prompt": "text"}, "more text"])
    replica, sent = scope_stage0(batch, pool=pool, hasher=HASHER)
    assert replica is None and type(sent) is list and sent == [{"prompt": "text"}, "more text"]

    # Under a repeated UUID the items are compared; vLLM reads them again (an array of
    # videos by iterating it), so the prompt goes on as the record's plain arrays.
    stacked = np.stack([video_array(1), video_array(1)]).view(_Clips)
    clips = {
        "prompt": "<video><video>",
        "multi_modal_data": {"video": stacked},
        "multi_modal_uuids": {"video": ["v", "v"]},
    }
    sent = scope_stage0(clips, pool=pool, hasher=HASHER)[1]
    assert [type(video) for video in sent["multi_modal_data"]["video"]] == [np.ndarray, np.ndarray]
    assert all(np.array_equal(video, video_array(1)) for video in sent["multi_modal_data"]["video"])


@pytest.mark.parametrize("pool", PASSING_POOLS[:2], ids=PASSING_IDS[:2])
def test_a_dict_changed_by_the_callers_code_after_its_check_goes_on_as_it_was_read(pool: Stage0Pool) -> None:
    images = [image_array(1), image_array(2)]
    rewritten = ["stage0:rep0:c1", "c1"]  # an engine's scope, and one UUID over two images

    def fresh() -> dict[str, Any]:
        return {
            "prompt": "<image><image>",
            "multi_modal_data": {"image": images},
            "multi_modal_uuids": {"image": ["c1", "c2"]},
        }

    class Rewriting(list[Any]):
        """A UUID row whose iteration rewrites the dict before it in the batch."""

        def __iter__(self) -> Iterator[Any]:
            victim["multi_modal_uuids"]["image"][:] = rewritten
            return super().__iter__()

    victim = fresh()
    odd = {
        "prompt": "<image>",
        "multi_modal_data": {"image": images[0]},
        "multi_modal_uuids": {"image": Rewriting(["dog"])},
    }
    _, sent = scope_stage0([victim, odd], pool=pool, hasher=HASHER)
    assert victim["multi_modal_uuids"]["image"] == rewritten  # the caller's code ran ...
    assert sent[0] is not victim and sent[0]["multi_modal_uuids"] == {
        "image": ["c1", "c2"]
    }  # ... after the read

    # select is the caller's code too, run after every check.
    victim = fresh()

    def select(request: RouteRequest) -> None:
        victim["multi_modal_uuids"]["image"][:] = rewritten

    _, sent = scope_stage0(victim, pool=_pool(2, select), hasher=HASHER)
    assert victim["multi_modal_uuids"]["image"] == rewritten
    assert sent is not victim and sent["multi_modal_uuids"] == {"image": ["c1", "c2"]}


@pytest.mark.parametrize("pool", PASSING_POOLS[:2], ids=PASSING_IDS[:2])
def test_a_prompt_keyed_for_the_digest_check_goes_on_as_it_was_keyed(pool: Stage0Pool) -> None:
    # A UUID shaped like a digest makes the pass-through key the prompt (is it vLLM's key
    # of another item?). That read of the media is the caller's code too: a media row
    # answering vLLM's second read otherwise, or an image whose loader rewrites a dict
    # already checked, went on as the caller's own (found by a review, helper-79).
    a, b, x = image_array(1), image_array(2), image_array(3)
    digest_of_b = HASHER.key("image", b)
    lying = {
        "prompt": "<image><image>",
        "multi_modal_data": {"image": FirstReadAs([a, x], [a, b])},
        "multi_modal_uuids": {"image": [digest_of_b, None]},
    }
    replica, sent = scope_stage0(lying, pool=pool, hasher=HASHER)
    row = sent["multi_modal_data"]["image"]
    assert replica is None and sent is not lying and type(row) is list  # vLLM gets what was checked
    assert [np.array_equal(got, want) for got, want in zip(row, [a, x], strict=True)] == [True, True]
    with pytest.raises(InvalidPromptError, match="is the content key of multi_modal_data"):  # read honestly
        scope_stage0({**lying, "multi_modal_data": {"image": [a, b]}}, pool=pool, hasher=HASHER)

    victim = {
        "prompt": "<image>",
        "multi_modal_data": {"image": image_array(4)},
        "multi_modal_uuids": {"image": ["photo"]},
    }

    class Loading(Image.Image):
        def load(self) -> Any:
            victim["multi_modal_uuids"]["image"][0] = "stage0:rep1:photo"  # an engine's old key
            return super().load()

    loading = Loading()
    loading.__dict__.update(Image.fromarray(b).__dict__)
    keyed = {
        "prompt": "<image>",
        "multi_modal_data": {"image": [loading]},
        "multi_modal_uuids": {"image": [digest_of_b]},
    }
    _, sent = scope_stage0([victim, keyed], pool=pool, hasher=HASHER)
    assert victim["multi_modal_uuids"]["image"] == ["stage0:rep1:photo"]  # the caller's code ran ...
    assert sent[0] is not victim and sent[0]["multi_modal_uuids"] == {
        "image": ["photo"]
    }  # ... after the read


class _Subclassed(dict[str, Any]):
    pass


def test_a_rendered_inputs_media_keys_are_checked_as_vllm_reads_them() -> None:
    # vLLM keys a rendered input's media by its mm_hashes, read by [] and [i] (see
    # tests/vllm/test_template_reuse.py for a real one); here only their shape matters.
    def rendered(hashes: Any) -> dict[str, Any]:
        return {
            "type": "multimodal",
            "prompt_token_ids": [1, 2],
            "mm_kwargs": {},
            "mm_hashes": hashes,
            "mm_placeholders": {},
        }

    scoped = "stage0:rep0:abc"
    for pool in (_pool(2, lambda _: 1), *PASSING_POOLS):
        pair = {
            "type": "enc_dec",
            "encoder_prompt": rendered({"image": [scoped]}),
            "decoder_prompt": rendered({}),
        }
        with pytest.raises(InvalidPromptError, match="already scoped") as caught:
            scope_stage0(pair, pool=pool, hasher=HASHER)
        assert caught.value.path == "$.encoder_prompt.mm_hashes.image[0]"
        for hashes, path in (
            ({"image": IndexedAs(["abc"], [scoped])}, "$.mm_hashes.image"),
            ({"image": [_Uuid(scoped)]}, "$.mm_hashes.image"),
            (types.MappingProxyType({"image": ["abc"]}), "$.mm_hashes"),
        ):
            with pytest.raises(PromptTypeError) as caught:
                scope_stage0(rendered(hashes), pool=pool, hasher=HASHER)
            assert caught.value.path == path
        clean = rendered({"image": ["abc", "abc"]})  # vLLM's own keys: the same image twice
        assert scope_stage0(clean, pool=pool, hasher=HASHER) == (None, clean)
        # Held by a dict subclass it is read as a prompt (its code could answer otherwise
        # the second time), which no record holds: refused as a rendered input, by name,
        # not as a prompt with an unknown field.
        with pytest.raises(InvalidPromptError, match=r"already rendered.*only in a plain dict") as caught:
            scope_stage0(_Subclassed(clean), pool=pool, hasher=HASHER)
        assert caught.value.path == "$.type"


def test_an_engine_scoped_uuid_is_refused_on_every_road_media_or_not() -> None:
    scoped = {"prompt": "x", "multi_modal_uuids": {"image": ["stage0:rep1:abc"]}}
    for pool in (_pool(2, lambda _: 1), *PASSING_POOLS):
        with pytest.raises(InvalidPromptError, match="already scoped") as caught:
            scope_stage0(["y", scoped], pool=pool, hasher=HASHER)
        assert caught.value.path == "$[1].multi_modal_uuids.image[0]"


def test_media_behind_a_field_name_that_hides_them_are_routed() -> None:
    image = image_array(1)
    hiding = {"prompt": "<image>", _KeyFor("multi_modal_data", 5): {"image": image}}
    replica, sent = scope_stage0(hiding, pool=_pool(2, lambda _: 1), hasher=HASHER)
    assert replica == 1 and sent["multi_modal_uuids"] == {
        "image": [f"stage0:rep1:{HASHER.key('image', image)}"]
    }


class _LooksEmpty(collections.abc.Mapping[str, Any]):
    """Media whose own ``len`` and truth say there are none; its keys and items say otherwise."""

    def __init__(self, held: dict[str, Any]) -> None:
        self.held = held

    def __getitem__(self, key: str) -> Any:
        return self.held[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.held)

    def __len__(self) -> int:
        return 0


def test_media_that_say_they_are_none_are_read_and_scoped_not_passed_on() -> None:
    image = image_array(1)
    hiding = {"prompt": "<image>", "multi_modal_data": _LooksEmpty({"image": image})}
    replica, sent = scope_stage0(hiding, pool=_pool(2, lambda _: 1), hasher=HASHER)
    assert replica == 1 and sent is not hiding
    assert sent["multi_modal_uuids"] == {"image": [f"stage0:rep1:{HASHER.key('image', image)}"]}


# -- the core's property checks, pointed at scope_stage0 -------------------------------------


def _through_scope_stage0(prompt: Any, replica: int) -> Any:
    return scope_stage0(prompt, pool=_pool(4, lambda _: replica), hasher=HASHER, request_id="req")


@pytest.mark.parametrize("shape", ["records", "dicts"])
def test_scope_stage0_passes_the_cores_scoping_properties(shape: str) -> None:
    testing = pytest.importorskip("omni_requests.testing")
    testing.check_scoping(
        _through_scope_stage0,
        to_dict=to_vllm if shape == "dicts" else None,
        replicas=4,
        settings=settings(max_examples=25),
    )


def test_items_are_counted_the_way_vllm_counts_them_not_one_per_list_element() -> None:
    """A video given as its frames is one item (one key); an image batch array is N items."""
    frames = [image_array(1), image_array(2), image_array(3)]
    batch = np.stack([image_array(4), image_array(5)])
    prompt = {"prompt": "<video><image><image>", "multi_modal_data": {"video": frames, "image": batch}}
    _, out = scope_stage0(prompt, pool=_pool(2, lambda _: 0), hasher=HASHER)
    assert len(out["multi_modal_uuids"]["video"]) == 1
    assert out["multi_modal_uuids"]["image"] == [
        "stage0:rep0:" + HASHER.key("image", image_array(4)),
        "stage0:rep0:" + HASHER.key("image", image_array(5)),
    ]


def test_images_differing_only_in_exif_image_id_are_different_records_with_different_keys() -> None:
    """vLLM keys an image with an EXIF ImageID by that UUID; record equality must follow."""
    plain, tagged = Image.new("RGB", (1, 1)), Image.new("RGB", (1, 1))
    tagged.getexif()[0x800D] = uuid.UUID(int=0)
    a = TextPrompt(prompt="<image>", multi_modal_data={"image": plain})
    b = TextPrompt(prompt="<image>", multi_modal_data={"image": tagged})
    assert HASHER.key("image", plain) != HASHER.key("image", tagged)
    assert a != b


# -- routing a reused template -----------------------------------------------------------------


def _routed_keys(prompt: Any, hasher: MediaHasher = HASHER) -> tuple[str, ...]:
    """The media keys the pool's policy was shown for ``prompt``."""
    select = Recorder(0)
    scope_stage0(prompt, pool=_pool(2, select), hasher=hasher)
    return select.seen[0].media_keys


def test_a_templates_routing_keys_are_derived_once_per_hasher(monkeypatch: pytest.MonkeyPatch) -> None:
    import omni_requests._scoping as scoping

    from ..conftest import record_calls

    template = TextPrompt(
        prompt="<image><image>",
        multi_modal_data={"image": [image_array(1), image_array(2)]},
        multi_modal_uuids={"image": ["cat", None]},
    )
    walked = record_calls(monkeypatch, scoping, "_derive", 0)
    expected = ("cat", HASHER.content_key("image", image_array(2)))
    for _ in range(3):  # records come back as records: no render walks the keys
        assert _routed_keys(template) == expected
    assert walked == [template]  # routing walked the media once; later requests read the memo
    other = MediaHasher("/models/another-model")
    assert _routed_keys(template, other) == ("cat", other.content_key("image", image_array(2))) != expected
    assert len(walked) == 2  # one walk per hasher


def test_routing_keys_follow_an_item_that_can_change_and_new_media() -> None:
    # A palette image is kept as given, unsealed: its holder's writes reach the record, so
    # the keys routing reads are derived again at every request, never remembered.
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 255, 255, 255] * 128)
    template = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    assert template.multi_modal_data["image"][0] is image
    before = _routed_keys(template)
    image.putpixel((0, 0), 0)
    assert _routed_keys(template) == (HASHER.content_key("image", image),) != before
    # A copy of a routed template given other media routes by its own.
    arrays = TextPrompt(prompt="<image>", multi_modal_data={"image": image_array(1)})
    assert _routed_keys(arrays) == (HASHER.content_key("image", image_array(1)),)
    for changed in (
        arrays.replace_media({"image": image_array(2)}),
        attrs.evolve(arrays, multi_modal_data={"image": image_array(2)}),
        scope_to_replica(arrays, 1, hasher=HASHER).replace_media({"image": image_array(2)}),
    ):
        assert _routed_keys(changed) == (HASHER.content_key("image", image_array(2)),)


# -- a record scoped before, where nothing is scoped (found by a review, helper-63) -------------

_TENANT = KeyPolicy(tenant="acme", tenant_content=True)


def _scoped_before(policy: KeyPolicy | None) -> TextPrompt:
    """A record a first request scoped to replica 1 (a retry sends it again)."""
    record = TextPrompt(
        prompt="<image>", multi_modal_data={"image": [image_array(2)]}, multi_modal_uuids={"image": ["cat"]}
    )
    return scope_to_replica(record, 1, hasher=HASHER, policy=policy)


@pytest.mark.parametrize("policy", [None, _TENANT], ids=["retry", "tenant"])
@pytest.mark.parametrize("batch", [False, True])
def test_a_scoped_record_with_one_live_replica_is_scoped_to_it(policy: KeyPolicy | None, batch: bool) -> None:
    # It passed through in its old scope: replica 0 got replica 1's key, which the
    # frontend's cache holds as sent, so the image was left out and replica 0 missed.
    record = _scoped_before(policy)
    select = Recorder(0)
    prompts: Any = [record, {"prompt": "x"}] if batch else record
    replica, out = scope_stage0(prompts, pool=Stage0Pool(replicas=[0], select=select), hasher=HASHER)
    scoped = out[0] if batch else out
    assert replica == 0 and scoped == scope_to_replica(record, 0, hasher=HASHER)
    assert scoped.scope.policy == (policy or KeyPolicy())
    assert [request.replicas for request in select.seen] == [(0,)]


@pytest.mark.parametrize(
    ("pool", "why"),
    [
        (Stage0Pool(replicas=2, select=lambda _: None), "pool.select chose no replica"),
        (Stage0Pool(replicas=[], select=lambda _: None), "stage 0 has no live replica"),
        (Stage0Pool(replicas=2, select=lambda _: 0, is_diffusion=True), None),
    ],
    ids=["select-none", "no-replica", "diffusion"],
)
@pytest.mark.parametrize("shape", ["record", "list", "tuple", "pair"])
def test_a_scoped_record_is_never_passed_on_in_its_old_scope(
    pool: Stage0Pool, why: str | None, shape: str
) -> None:
    # Where nothing is scoped, a record in its old scope went out under keys naming
    # another replica's cache; unscoped, it gets the keys a fresh request gets. A
    # tenant's record is refused rather than sent without its policy, unless stage 0 is a
    # diffusion stage (no processor cache, no key to keep apart).
    def given(record: TextPrompt) -> Any:
        return {
            "record": record,
            "list": [{"prompt": "x"}, record],
            "tuple": ({"prompt": "x"}, record),
            "pair": EncoderDecoderPrompt(encoder_prompt=record, decoder_prompt=TextPrompt(prompt="hi")),
        }[shape]

    def sent(out: Any) -> Any:
        item = out[1] if shape in ("list", "tuple") else out
        return to_vllm(item.encoder_prompt if shape == "pair" else item)["multi_modal_uuids"]

    replica, out = scope_stage0(given(_scoped_before(None)), pool=pool, hasher=HASHER)
    assert replica is None and sent(out) == {"image": ["cat"]}
    assert (
        type(out) is {"record": TextPrompt, "list": list, "tuple": tuple, "pair": EncoderDecoderPrompt}[shape]
    )
    tenants = given(_scoped_before(_TENANT))
    if why is None:
        assert sent(scope_stage0(tenants, pool=pool, hasher=HASHER).prompts) == {"image": ["cat"]}
        return
    with pytest.raises(InvalidPromptError, match=re.escape(why)) as caught:
        scope_stage0(tenants, pool=pool, hasher=HASHER)
    assert caught.value.path == ("$[1]" if shape in ("list", "tuple") else "$")


@pytest.mark.parametrize("replicas", [2, 1, []], ids=["several", "one", "none"])
def test_a_scoped_record_without_media_goes_on_unscoped(replicas: Any) -> None:
    # Its UUIDs key nothing (vLLM reads them only beside media), so nothing is scoped; with
    # several replicas it went on in its old scope, and with none a tenant's was refused for
    # a policy that protects nothing here (found by a review, helper-79).
    for policy in (None, _TENANT):
        bare = TextPrompt(prompt="<image>", multi_modal_uuids={"image": ["cat"]})
        old = scope_to_replica(bare, 1, hasher=HASHER, policy=policy)
        pool = Stage0Pool(replicas=replicas, select=lambda _: 0)
        replica, out = scope_stage0([old, "x"], pool=pool, hasher=HASHER)
        assert replica is None and out == [bare, "x"]
        assert scope_stage0(old, pool=pool, hasher=HASHER, as_dicts=True).prompts == to_vllm(bare)


@pytest.mark.parametrize(
    ("pool", "media"),
    [
        *((pool, True) for pool in PASSING_POOLS),
        (_pool(2), False),
        (Stage0Pool(replicas=2, select=lambda _: 0, is_diffusion=True), True),
    ],
    ids=[*PASSING_IDS, "no_media", "diffusion"],
)
def test_as_dicts_hands_on_dicts_where_nothing_is_scoped_too(pool: Stage0Pool, media: bool) -> None:
    # "What process_inputs takes" held only where a replica was chosen: the pass-through
    # roads handed records on (found by a review, helper-79).
    record = (
        TextPrompt(
            prompt="<image>", multi_modal_data={"image": image_array(1)}, multi_modal_uuids={"image": ["cat"]}
        )
        if media
        else TextPrompt(prompt="hi")
    )
    pair = EncoderDecoderPrompt(encoder_prompt=record, decoder_prompt=TextPrompt(prompt="b"))
    text = {"prompt": "x"}
    replica, out = scope_stage0(record, pool=pool, hasher=HASHER, as_dicts=True)
    assert replica is None and deep_equal(out, to_vllm(record))
    replica, out = scope_stage0((record, pair, text, "y"), pool=pool, hasher=HASHER, as_dicts=True)
    assert replica is None and deep_equal(out, (to_vllm(record), to_vllm(pair), text, "y"))
    # Without it, records stay records.
    assert scope_stage0([record], pool=pool, hasher=HASHER).prompts == [record]


def test_a_diffusion_batch_of_any_sequence_comes_back_unscoped() -> None:
    # Only a plain list or tuple was read: a list subclass kept its record's old scope
    # (found by a review, helper-71).
    class Batch(list):  # type: ignore[type-arg]
        pass

    pool = Stage0Pool(replicas=2, select=lambda _: 0, is_diffusion=True)
    for batch in (Batch([_scoped_before(None)]), collections.UserList([_scoped_before(_TENANT)])):
        _, out = scope_stage0(batch, pool=pool, hasher=HASHER)
        assert [item.scope for item in out] == [None]
