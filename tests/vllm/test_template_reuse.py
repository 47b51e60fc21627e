"""The template-reuse bug, through vLLM's real processor caches.

One renderer is one frontend with one processor ("sender") cache; each stage-0 replica's
engine core has its own receiver cache (vLLM's ``LruKeyReplicatedReceiverCache`` here).
On a sender hit the frontend sends no tensors and the replica's receiver fills them in
from what it cached under that key. So a key shared by two different media serves the
second request the first one's features.

A user's template prompt is used once, then copied three times with three new videos,
and the four requests are spread over two replicas:

* with records, every request is served its own video's features, for every routing;
* with the old engine's write-back dicts (a faithful model below), the copies carry the
  template's scoped key as a "user UUID", get ``stage0:rep1:stage0:rep0:<first hash>``,
  and the sender cache hits for the wrong video.
"""

from __future__ import annotations

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import itertools
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch
from _engine import features, render, same_features
from _tiny_models import TinyModel, build_input_processor
from PIL import Image
from vllm import SamplingParams
from vllm.multimodal.cache import LruKeyReplicatedReceiverCache
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.parse import MultiModalDataParser

from omni_requests import InvalidPromptError, MediaHasher, TextPrompt, scope_to_replica
from omni_requests_omni import Stage0Pool, scope_stage0
from omni_requests_vllm import from_vllm, to_vllm
from tests.omni._helpers import FirstReadAs, IndexedAs, image_array

pytestmark = pytest.mark.vllm

REPLICAS = (0, 1)


def _video(seed: int) -> np.ndarray:
    # Same shape for all, so a stale hit is silent (no placeholder mismatch to crash on).
    return np.random.default_rng(seed).integers(0, 256, (2, 28, 28, 3), dtype=np.uint8)


TEMPLATE_VIDEO, COPY_VIDEOS = _video(100), [_video(101), _video(102), _video(103)]


class Deployment:
    """One frontend (renderer, one sender cache) in front of stage-0 replicas (receivers)."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self.replicas = {r: LruKeyReplicatedReceiverCache(renderer.model_config) for r in REPLICAS}
        self.sender_hits: list[str] = []

    def serve(self, prompt: Mapping[str, Any], replica: int) -> tuple[list[str], list[dict[str, Any]]]:
        """Send one prompt dict to ``replica``: the keys it used and the features it was served."""
        result = render(self.renderer, prompt)
        keys = result["mm_hashes"]["video"]
        sent = result["mm_kwargs"]["video"]
        receiver = self.replicas[replica]
        served = []
        for key, item in zip(keys, sent, strict=True):
            if item is None:
                self.sender_hits.append(key)
            served.append(receiver.get_and_update_item(item, key).get_data())
        return keys, served


def _alone(uncached_renderer: Any, model: TinyModel, video: np.ndarray) -> dict[str, Any]:
    """The features of ``video`` processed by itself, with no cache involved."""
    result = render(
        uncached_renderer("qwen2_vl"), {"prompt": model.prompt(video=1), "multi_modal_data": {"video": video}}
    )
    (item,) = features(result)["video"]
    assert item is not None
    return item


# -- the old path, modelled faithfully --


def old_scope_in_place(prompt: dict[str, Any], replica: int, model_id: str) -> dict[str, Any]:
    """vllm-omni's stage-0 scoping before the fix: it wrote the scoped keys into the caller's dict.

    Per item the base is the user's UUID, else ``hash_kwargs(alg, model_id=..., <modality>=item)``;
    the key is ``stage0:rep{R}:{base}``; the result replaces the prompt's own
    ``multi_modal_uuids``, so whoever holds the dict now holds scoped keys.
    """
    scoped: dict[str, list[str]] = {}
    given_all = prompt.get("multi_modal_uuids") or {}
    for modality, value in prompt["multi_modal_data"].items():
        items = value if isinstance(value, list) else [value]
        given = given_all.get(modality)
        given = [given] if isinstance(given, str) else list(given or [None] * len(items))
        scoped[modality] = [
            f"stage0:rep{replica}:"
            + (
                uuid
                if uuid is not None
                else MultiModalHasher.hash_kwargs("blake3", model_id=model_id, **{modality: item})
            )
            for uuid, item in zip(given, items, strict=True)
        ]
    prompt["multi_modal_uuids"] = scoped
    return prompt


def test_the_write_back_path_serves_a_copy_the_wrong_videos_features(
    qwen2_vl: TinyModel, fresh_renderer: Any, uncached_renderer: Any
) -> None:
    deployment = Deployment(fresh_renderer("qwen2_vl"))
    first_hash = MultiModalHasher.hash_kwargs("blake3", model_id=qwen2_vl.model_id, video=TEMPLATE_VIDEO)

    template = {"prompt": qwen2_vl.prompt(video=1), "multi_modal_data": {"video": TEMPLATE_VIDEO}}
    deployment.serve(old_scope_in_place(template, 0, qwen2_vl.model_id), 0)
    assert template["multi_modal_uuids"] == {"video": [f"stage0:rep0:{first_hash}"]}  # the caller's dict

    # Three copies of the used template with new videos; rep0 is busy, all go to rep1.
    copies = [{**template, "multi_modal_data": {"video": video}} for video in COPY_VIDEOS]
    served = [deployment.serve(old_scope_in_place(copy, 1, qwen2_vl.model_id), 1) for copy in copies]

    stale = f"stage0:rep1:stage0:rep0:{first_hash}"
    assert [keys for keys, _ in served] == [[stale]] * 3  # one key for three videos, two prefixes
    assert deployment.sender_hits == [stale, stale]  # copies 2 and 3 hit the sender cache
    first_copy = _alone(uncached_renderer, qwen2_vl, COPY_VIDEOS[0])
    for video, (_, [got]) in zip(COPY_VIDEOS[1:], served[1:], strict=True):
        assert same_features(got, first_copy)  # served the first copy's video ...
        assert not same_features(got, _alone(uncached_renderer, qwen2_vl, video))  # ... not its own


def _requests(qwen2_vl: TinyModel, *, copy_from_engine_copy: bool) -> list[tuple[TextPrompt, np.ndarray]]:
    template = TextPrompt(prompt=qwen2_vl.prompt(video=1), multi_modal_data={"video": TEMPLATE_VIDEO})
    source = template
    if copy_from_engine_copy:
        # Even copying the engine's scoped record is safe: keys are derived, never stored.
        source = scope_to_replica(template, 0, hasher=MediaHasher(qwen2_vl.model_id))
    copies = [attrs.evolve(source, multi_modal_data={"video": video}) for video in COPY_VIDEOS]
    return [
        (template, TEMPLATE_VIDEO),
        *((copy, video) for copy, video in zip(copies, COPY_VIDEOS, strict=True)),
    ]


@pytest.mark.parametrize("copy_from_engine_copy", [False, True], ids=["copy-template", "copy-engine-copy"])
@pytest.mark.parametrize(
    "routing", list(itertools.product(REPLICAS, repeat=4)), ids=lambda r: "".join(map(str, r))
)
def test_records_serve_every_request_its_own_features(
    routing: tuple[int, ...],
    copy_from_engine_copy: bool,
    qwen2_vl: TinyModel,
    fresh_renderer: Any,
    uncached_renderer: Any,
    own_features: dict[int, dict[str, Any]],
) -> None:
    hasher = MediaHasher(qwen2_vl.model_id)
    deployment = Deployment(fresh_renderer("qwen2_vl"))
    requests = _requests(qwen2_vl, copy_from_engine_copy=copy_from_engine_copy)
    originals = [to_vllm(record) for record, _ in requests]

    all_keys = []
    for (record, video), replica in zip(requests, routing, strict=True):
        scoped = scope_to_replica(record, replica, hasher=hasher)
        keys, [got] = deployment.serve(to_vllm(scoped), replica)
        assert keys == [f"stage0:rep{replica}:{hasher.key('video', video)}"]
        assert same_features(got, own_features[id(video)])
        all_keys += keys

    assert len(set(all_keys)) == 4 and all(key.count("stage0:") == 1 for key in all_keys)
    assert deployment.sender_hits == []  # four different videos: nothing to hit
    # The caller's records are as they were: no scope, no keys written into them.
    for (record, _), original in zip(requests, originals, strict=True):
        assert to_vllm(record).get("multi_modal_uuids") == original.get("multi_modal_uuids")


@pytest.fixture(scope="module")
def own_features(qwen2_vl: TinyModel, uncached_renderer: Any) -> dict[int, dict[str, Any]]:
    return {id(v): _alone(uncached_renderer, qwen2_vl, v) for v in (TEMPLATE_VIDEO, *COPY_VIDEOS)}


def test_a_retry_on_another_replica_is_keyed_like_a_first_request_there(
    qwen2_vl: TinyModel, fresh_renderer: Any, own_features: dict[int, dict[str, Any]]
) -> None:
    hasher = MediaHasher(qwen2_vl.model_id)
    deployment = Deployment(fresh_renderer("qwen2_vl"))
    record = TextPrompt(prompt=qwen2_vl.prompt(video=1), multi_modal_data={"video": COPY_VIDEOS[0]})
    on_rep0 = scope_to_replica(record, 0, hasher=hasher)
    deployment.serve(to_vllm(on_rep0), 0)
    retried = scope_to_replica(on_rep0, 1, hasher=hasher)  # the engine's copy, rerouted
    keys, [got] = deployment.serve(to_vllm(retried), 1)
    assert keys == [f"stage0:rep1:{hasher.key('video', COPY_VIDEOS[0])}"]
    assert keys == deployment.serve(to_vllm(scope_to_replica(record, 1, hasher=hasher)), 1)[0]
    assert same_features(got, own_features[id(COPY_VIDEOS[0])])


def test_the_same_video_again_on_its_replica_is_a_correct_sender_hit(
    qwen2_vl: TinyModel, fresh_renderer: Any, own_features: dict[int, dict[str, Any]]
) -> None:
    hasher = MediaHasher(qwen2_vl.model_id)
    deployment = Deployment(fresh_renderer("qwen2_vl"))
    record = TextPrompt(prompt=qwen2_vl.prompt(video=1), multi_modal_data={"video": TEMPLATE_VIDEO})
    for _ in range(2):
        keys, [got] = deployment.serve(to_vllm(scope_to_replica(record, 1, hasher=hasher)), 1)
        assert same_features(got, own_features[id(TEMPLATE_VIDEO)])
    assert deployment.sender_hits == keys  # caching still works where sharing is right


def test_a_written_back_dict_is_refused_as_a_record(qwen2_vl: TinyModel) -> None:
    template = {"prompt": qwen2_vl.prompt(video=1), "multi_modal_data": {"video": TEMPLATE_VIDEO}}
    old_scope_in_place(template, 0, qwen2_vl.model_id)
    with pytest.raises(InvalidPromptError, match="already scoped") as caught:
        from_vllm({**template, "multi_modal_data": {"video": COPY_VIDEOS[0]}})
    assert caught.value.path == "$.multi_modal_uuids.video[0]"


def test_one_uuid_over_two_videos_serves_the_second_the_firsts_features(
    qwen2_vl: TinyModel, fresh_renderer: Any, own_features: dict[int, dict[str, Any]]
) -> None:
    # vLLM takes the dict as given: one cache entry for two videos.
    first, second = TEMPLATE_VIDEO, COPY_VIDEOS[0]
    deployment = Deployment(fresh_renderer("qwen2_vl"))
    shared = {
        "prompt": qwen2_vl.prompt(video=2),
        "multi_modal_data": {"video": [first, second]},
        "multi_modal_uuids": {"video": ["clip", "clip"]},
    }
    keys, served = deployment.serve(shared, 0)
    assert keys == ["clip", "clip"]
    assert same_features(served[1], own_features[id(first)])
    assert not same_features(served[1], own_features[id(second)])

    # A record refuses it before anything is built, and the dict is left as it was.
    with pytest.raises(InvalidPromptError, match="also names multi_modal_data") as caught:
        from_vllm(shared)
    assert caught.value.path == "$.multi_modal_uuids.video[1]"
    assert shared["multi_modal_uuids"] == {"video": ["clip", "clip"]}

    # A cached-only item under its sender's UUID is taken, as vLLM takes it: from its
    # cache, which it reads before this prompt's items go in (so not on a first request).
    twin = from_vllm({**shared, "multi_modal_data": {"video": [first, None]}})
    fresh = Deployment(fresh_renderer("qwen2_vl"))
    with pytest.raises(ValueError, match="Cache miss for video at index 1"):
        fresh.serve(to_vllm(twin), 0)
    fresh.serve(
        {
            "prompt": qwen2_vl.prompt(video=1),
            "multi_modal_data": {"video": first},
            "multi_modal_uuids": {"video": "clip"},
        },
        0,
    )
    keys, served = fresh.serve(to_vllm(twin), 0)
    assert keys == ["clip", "clip"] and same_features(served[1], own_features[id(first)])

    # Each video under its own UUID is served its own features.
    record = from_vllm({**shared, "multi_modal_uuids": {"video": ["clip-1", "clip-2"]}})
    keys, served = Deployment(fresh_renderer("qwen2_vl")).serve(to_vllm(record), 0)
    assert keys == ["clip-1", "clip-2"]
    assert same_features(served[1], own_features[id(second)])


@pytest.mark.parametrize(
    "pool",
    [Stage0Pool(replicas=1, select=lambda _: 0), Stage0Pool(replicas=2, select=lambda _: None)],
    ids=["one_replica", "none_selected"],
)
def test_stage0_hands_vllm_what_it_checked_where_nothing_is_scoped(
    pool: Stage0Pool, qwen2_vl: TinyModel, fresh_renderer: Any, own_features: dict[int, dict[str, Any]]
) -> None:
    # vLLM reads a UUID row by [i]; a row whose own code answers that otherwise than its
    # iteration would give two videos one cache entry, past a check that iterated it.
    first, second = TEMPLATE_VIDEO, COPY_VIDEOS[0]
    lying = {
        "prompt": qwen2_vl.prompt(video=2),
        "multi_modal_data": {"video": [first, second]},
        "multi_modal_uuids": {"video": IndexedAs(["clip-1", "clip-2"], ["clip", "clip"])},
    }
    keys, served = Deployment(fresh_renderer("qwen2_vl")).serve(lying, 0)
    assert keys == ["clip", "clip"] and same_features(served[1], own_features[id(first)])  # the hazard

    replica, sent = scope_stage0(lying, pool=pool, hasher=MediaHasher(qwen2_vl.model_id))
    assert replica is None
    keys, served = Deployment(fresh_renderer("qwen2_vl")).serve(sent, 0)
    assert keys == ["clip-1", "clip-2"]
    assert same_features(served[0], own_features[id(first)])
    assert same_features(served[1], own_features[id(second)])

    # Items too: under one UUID the check saw one video twice; vLLM, which iterates the
    # row again, is sent that, not another video at [0] whose features "clip" would name.
    same = {
        **lying,
        "multi_modal_data": {"video": FirstReadAs([first, first], [second, first])},
        "multi_modal_uuids": {"video": ["clip", "clip"]},
    }
    _, sent = scope_stage0(same, pool=pool, hasher=MediaHasher(qwen2_vl.model_id))
    keys, served = Deployment(fresh_renderer("qwen2_vl")).serve(sent, 0)
    assert keys == ["clip", "clip"]
    assert all(same_features(got, own_features[id(first)]) for got in served)


def _every_road() -> tuple[Stage0Pool, ...]:
    """Stage 0 scoping to replica 1, passing through on one replica, and choosing none."""
    return (
        Stage0Pool(replicas=2, select=lambda _: 1),
        Stage0Pool(replicas=1, select=lambda _: 0),
        Stage0Pool(replicas=2, select=lambda _: None),
    )


def test_a_rendered_input_keyed_under_a_replicas_scope_is_refused(
    qwen2_vl: TinyModel, fresh_renderer: Any
) -> None:
    # vLLM's process_inputs takes a dict with a "type" as rendered and keys its media by
    # its mm_hashes as given: one naming a replica's scoped key would overwrite that
    # replica's entry for another request. (A chat part's uuid becomes such a key.)
    hasher = MediaHasher(qwen2_vl.model_id)
    prompt = {"prompt": qwen2_vl.prompt(video=1), "multi_modal_data": {"video": COPY_VIDEOS[0]}}
    renderer = fresh_renderer("qwen2_vl")
    rendered = render(renderer, prompt)
    forged = {**rendered, "mm_hashes": {"video": [f"stage0:rep1:{hasher.key('video', TEMPLATE_VIDEO)}"]}}
    processor = build_input_processor(renderer)
    request = processor.process_inputs("forged", forged, SamplingParams(max_tokens=1), ("generate",))
    assert [feature.identifier for feature in request.mm_features] == forged["mm_hashes"][
        "video"
    ]  # vLLM keys it so

    for pool in _every_road():
        with pytest.raises(InvalidPromptError, match="already scoped") as caught:
            scope_stage0(["text", forged], pool=pool, hasher=hasher)
        assert caught.value.path == "$[1].mm_hashes.video[0]"
        # Unforged, it goes on as it is: rendered before stage 0 chose a replica, its keys
        # (and the frontend cache's lookups under them) cannot be scoped any more.
        assert scope_stage0(rendered, pool=pool, hasher=hasher) == (None, rendered)


def test_a_uuid_that_is_another_items_content_key_is_refused(
    qwen2_vl: TinyModel, fresh_renderer: Any, own_features: dict[int, dict[str, Any]]
) -> None:
    # vLLM keys an item without a UUID by its content: a UUID equal to that key names
    # the same cache entry, and one of the two videos is served the other's features.
    hasher = MediaHasher(qwen2_vl.model_id)
    first, second = TEMPLATE_VIDEO, COPY_VIDEOS[0]
    clash = {
        "prompt": qwen2_vl.prompt(video=2),
        "multi_modal_data": {"video": [first, second]},
        "multi_modal_uuids": {"video": [hasher.key("video", second), None]},
    }
    keys, served = Deployment(fresh_renderer("qwen2_vl")).serve(clash, 0)
    assert keys[0] == keys[1] and same_features(served[1], own_features[id(first)])  # the hazard

    for pool in _every_road():
        with pytest.raises(InvalidPromptError, match="is the content key of multi_modal_data") as caught:
            scope_stage0(["text", clash], pool=pool, hasher=hasher)
        assert caught.value.path == "$[1].multi_modal_uuids.video[0]"
    with pytest.raises(InvalidPromptError, match="is the content key"):  # keys are made as it renders
        to_vllm(scope_to_replica(from_vllm(clash), 0, hasher=hasher))

    # Where nothing is scoped vLLM keys the items itself: a video given as a list of
    # frames it keys by np.array(frames), which the UUID may be too.
    frames = {**clash, "multi_modal_data": {"video": [first, list(second)]}}
    keys, served = Deployment(fresh_renderer("qwen2_vl")).serve(frames, 0)
    assert keys[0] == keys[1] and same_features(served[1], own_features[id(first)])
    for pool in _every_road()[1:]:
        with pytest.raises(InvalidPromptError, match="is vLLM's key of multi_modal_data") as caught:
            scope_stage0(frames, pool=pool, hasher=hasher)
        assert caught.value.path == "$.multi_modal_uuids.video[0]"

    # The UUID of an item that is its own content key names one media: taken, as vLLM
    # serves both their own (equal) features.
    same = {**clash, "multi_modal_data": {"video": [second, second.copy()]}}
    _, sent = scope_stage0(same, pool=Stage0Pool(replicas=1, select=lambda _: 0), hasher=hasher)
    keys, served = Deployment(fresh_renderer("qwen2_vl")).serve(sent, 0)
    assert keys[0] == keys[1] and all(same_features(got, own_features[id(second)]) for got in served)


_WAVE = np.random.default_rng(7).standard_normal(1600).astype(np.float32)


def _transparent_image() -> Image.Image:
    """An RGB image whose transparency colour its top rows have: vLLM 0.34 flattens them
    over white, 0.32 and before do not (docs/vllm-parity.md)."""
    pixels = np.random.default_rng(8).integers(0, 200, (56, 56, 3), dtype=np.uint8)
    pixels[:20] = (0, 255, 0)
    image = Image.fromarray(pixels)
    image.info["transparency"] = (0, 255, 0)
    return image


@pytest.mark.parametrize(
    ("model_name", "modality", "other"),
    [
        ("qwen2_vl", "video", (COPY_VIDEOS[0], {"fps": 2.0})),
        ("qwen2_audio", "audio", (_WAVE, 16000)),
        ("qwen2_audio", "audio", [float(x) for x in _WAVE[:800]]),
        ("qwen2_audio", "audio", torch.from_numpy(_WAVE)),
        ("qwen2_audio", "audio", np.stack([_WAVE, _WAVE[::-1]])),
        ("qwen2_vl", "image", _transparent_image()),
    ],
    ids=[
        "video_with_metadata",
        "audio_at_the_models_rate",
        "audio_as_floats",
        "audio_tensor",
        "audio_two_channels",
        "image_that_vllm_versions_parse_apart",
    ],
)
def test_where_nothing_is_scoped_vllms_own_key_of_another_item_is_refused_as_a_uuid(
    tiny_models: dict[str, TinyModel], fresh_renderer: Any, model_name: str, modality: str, other: Any
) -> None:
    # Forms vLLM's parser changes before it hashes: its key of `other` is not our
    # content_key, so the check must know vLLM's too (docs/vllm-parity.md lists them).
    model = tiny_models[model_name]
    first = {"video": TEMPLATE_VIDEO, "audio": np.zeros(1600, np.float32), "image": TEMPLATE_VIDEO[0]}[
        modality
    ]
    plain = {"prompt": model.prompt(**{modality: 2}), "multi_modal_data": {modality: [first, other]}}
    vllm_key = render(fresh_renderer(model_name), plain)["mm_hashes"][modality][1]
    alias = {**plain, "multi_modal_uuids": {modality: [vllm_key, None]}}
    assert len(set(render(fresh_renderer(model_name), alias)["mm_hashes"][modality])) == 1  # vLLM: one key

    hasher = MediaHasher(model.model_id)
    for pool in _every_road()[1:]:
        with pytest.raises(InvalidPromptError, match="key of multi_modal_data") as caught:
            scope_stage0(alias, pool=pool, hasher=hasher)
        assert caught.value.path == f"$.multi_modal_uuids.{modality}[0]"


def test_the_vllm_key_check_compares_within_one_vllm_version_and_knows_items_kept_as_given() -> None:
    # Found by a review (helper-80). X is an RGB image whose transparency colour (green)
    # some pixels have; vLLM 0.34 keys it by its flattened parse, K. Y has X's flattened
    # pixels and another transparency colour (red) that it has; its UUID is K. K is Y's
    # key only as vLLM 0.32 reads Y (as it is), X's only as 0.34 does: no one vLLM keys
    # both so, and 0.34 gives the model other pixels for each under one key.
    parser, hasher = MultiModalDataParser(), MediaHasher("m")

    def vllm_key(image: Any) -> str:
        (parsed,) = parser.parse_mm_data({"image": [image]})["image"].get_all_items_for_hash()
        return str(MultiModalHasher.hash_kwargs("blake3", model_id="m", image=parsed))

    pixels = np.random.default_rng(9).integers(0, 200, (8, 8, 3), dtype=np.uint8)
    pixels[:2], pixels[6:] = (0, 255, 0), (255, 0, 0)
    x = Image.fromarray(pixels)
    x.info["transparency"] = (0, 255, 0)
    pixels[:2] = 255
    y = Image.fromarray(pixels)
    y.info["transparency"] = (255, 0, 0)
    key = vllm_key(x)
    seen = [np.asarray(parser.parse_mm_data({"image": image})["image"].get(0)) for image in (x, y)]
    assert not np.array_equal(*seen)  # two inputs to vLLM 0.34's model under one key
    prompt = {
        "prompt": "x",
        "multi_modal_data": {"image": [y, x]},
        "multi_modal_uuids": {"image": [key, None]},
    }
    # A list of images as one item is kept as it is, and vLLM's hasher keys it by each
    # image's EXIF ImageID; our content key is of its pixels.
    tagged = [Image.new("RGB", (8, 8), (9, 9, 9))]
    tagged[0].getexif()[0x800D] = uuid.UUID(int=3)
    listed = {
        "prompt": "x",
        "multi_modal_data": {"image": [image_array(5), tagged]},
        "multi_modal_uuids": {"image": [vllm_key(tagged), None]},
    }
    # A lone image whose EXIF orientation Pillow cannot apply keeps its ImageID through
    # vLLM's parser, which keys it by the ID; our content key is of its pixels (helper-81).
    unturned = Image.new("RGB", (8, 8), (10, 20, 30))
    exif = unturned.getexif()
    exif[0x800D], exif[0x0112] = uuid.UUID(int=4), [6]
    lone = {
        "prompt": "x",
        "multi_modal_data": {"image": [image_array(6), unturned]},
        "multi_modal_uuids": {"image": [vllm_key(unturned), None]},
    }
    for given in (prompt, listed, lone):
        for pool in _every_road()[1:]:
            with pytest.raises(InvalidPromptError, match="is vLLM's key of multi_modal_data") as caught:
                scope_stage0(given, pool=pool, hasher=hasher)
            assert caught.value.path == "$.multi_modal_uuids.image[0]"


def test_the_vllm_key_check_refuses_by_name_and_takes_a_cached_item_under_its_own_key() -> None:
    hasher = MediaHasher("m")
    digest = "a" * 64
    ragged = [np.zeros((28, 28, 3), np.uint8), np.zeros((14, 28, 3), np.uint8)]
    for pool in _every_road()[1:]:
        # Frames vLLM cannot stack: not keyed in that form (vLLM fails on them too).
        prompt = {
            "prompt": "x",
            "multi_modal_data": {"video": [TEMPLATE_VIDEO, ragged]},
            "multi_modal_uuids": {"video": [digest, None]},
        }
        scope_stage0(prompt, pool=pool, hasher=hasher)
        # A cached-only item under the key of the media the prompt sends names that media.
        cached = {
            "prompt": "x",
            "multi_modal_data": {"video": [None, list(TEMPLATE_VIDEO)]},
            "multi_modal_uuids": {"video": [hasher.key("video", TEMPLATE_VIDEO), None]},
        }
        scope_stage0(cached, pool=pool, hasher=hasher)
