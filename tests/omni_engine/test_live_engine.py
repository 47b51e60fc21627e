"""vllm-omni's own engine with stage 0 on two replicas: the bug in its tokens, and the cure.

One ``Omni`` (vllm-omni 0.30 over the CPU build of vLLM 0.30, a tiny random Qwen2-VL,
greedy, four tokens with logprobs) serves every test here. The reference for a video is
what the same engine answers when the video is sent alone in a fresh dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from omni_requests import InvalidPromptError, KeyPolicy, MediaHasher, TextPrompt, scope_to_replica
from omni_requests_omni import (
    CacheAffinity,
    RouteRequest,
    Stage0Balancer,
    Stage0Scoping,
    install_stage0_scoping,
)

from ._tiny_model import prompt
from .conftest import OMNI_MISSING, answer, video

pytest.importorskip("vllm_omni", reason=OMNI_MISSING)
pytestmark = pytest.mark.omni_engine

Answer = tuple[tuple[int, ...], tuple[float, ...]]
SEEDS = range(7)


@pytest.fixture(scope="module")
def references(omni: Any) -> dict[int, Answer]:
    """Each video alone, in a fresh dict without UUIDs: what every request for it should get."""
    return {
        seed: answer(
            omni.generate({"prompt": prompt(), "multi_modal_data": {"video": video(seed)}}, use_tqdm=False)[0]
        )
        for seed in SEEDS
    }


@pytest.fixture
def hasher(omni: Any) -> MediaHasher:
    """The engine's content keys: its model string, stage 0's default hash algorithm."""
    return MediaHasher(str(omni.engine.model), "blake3")


@pytest.fixture
def engine_key(omni: Any) -> Callable[[Any], str]:
    """The content key vllm-omni 0.30 computes itself, with vLLM 0.30's hasher.

    vLLM 0.30 hashed without framing its chunks (0.31 added it), so these strings differ
    from :class:`MediaHasher`'s, which are vLLM 0.31+'s. Both are content keys; the
    scoped key reaches vLLM as a UUID, used verbatim, so nothing needs them equal.
    """
    from vllm.multimodal.hasher import MultiModalHasher

    return lambda item: str(
        MultiModalHasher.hash_kwargs("blake3", model_id=str(omni.engine.model), video=item)
    )


@pytest.fixture
def install(omni: Any) -> Iterator[Callable[..., Stage0Scoping]]:
    """Install our scoping into the live engine for one test; the engine gets its own back after."""
    installed: list[Stage0Scoping] = []

    def run(**kwargs: Any) -> Stage0Scoping:
        if installed:
            installed.pop().uninstall()
        installed.append(install_stage0_scoping(omni.engine, **kwargs))
        return installed[-1]

    yield run
    for scoping in installed:
        scoping.uninstall()


def test_the_tiny_model_tells_the_videos_apart(references: dict[int, Answer]) -> None:
    assert len(set(references.values())) == len(SEEDS)
    assert len({tokens for tokens, _ in references.values()}) > 1  # not only the logprobs differ


def test_upstream_answers_a_copy_with_another_copys_video(
    generate: Callable[[Any], Answer], references: dict[int, Answer], engine_key: Callable[[Any], str]
) -> None:
    """vllm-omni 0.30 as it is: its stage-0 scoping writes the scoped keys into the caller's dict.

    This asserts upstream's wrong answer; the day it fails, read what upstream changed.
    """
    template = {"prompt": prompt(), "multi_modal_data": {"video": video(0)}}
    answers = [generate(template)]
    copies = []
    for seed in (1, 2, 3):
        copy = dict(
            template, multi_modal_data={"video": video(seed)}
        )  # shallow: the used template's keys come along
        answers.append(generate(copy))
        copies.append(copy)

    h0 = engine_key(video(0))
    (first,) = template["multi_modal_uuids"]["video"]  # written into the caller's dict
    a = int(first.removeprefix("stage0:rep")[0])
    b = 1 - a
    assert first == f"stage0:rep{a}:{h0}"
    assert [copy["multi_modal_uuids"]["video"] for copy in copies] == [
        [f"stage0:rep{b}:stage0:rep{a}:{h0}"],  # copy 1 fills this key with video 1 on replica b
        [f"stage0:rep{a}:stage0:rep{a}:{h0}"],
        [f"stage0:rep{b}:stage0:rep{a}:{h0}"],  # copy 3 hits it
    ]
    assert answers[:3] == [references[0], references[1], references[2]]
    assert answers[3] == references[1] != references[3]  # video 3 answered with video 1's tokens and logprobs
    print("\nupstream:", *zip((0, 1, 2, 3), answers, strict=True), sep="\n  ")


def test_our_scoping_installed_answers_every_copy_right(
    install: Callable[..., Stage0Scoping],
    generate: Callable[[Any], Answer],
    sent_keys: list[list[str]],
    references: dict[int, Answer],
    hasher: MediaHasher,
) -> None:
    scoping = install()
    assert scoping.hasher == hasher
    v0 = video(0)
    template = {"prompt": prompt(), "multi_modal_data": {"video": v0}}
    answers = [generate(template)]
    copies = []
    for seed in (1, 2, 3):
        copy = dict(template, multi_modal_data={"video": video(seed)})
        answers.append(generate(copy))
        copies.append(copy)

    assert answers == [references[seed] for seed in (0, 1, 2, 3)]
    print("\ninstalled:", *zip((0, 1, 2, 3), answers, sent_keys, strict=True), sep="\n  ")
    # The caller's dicts are as they were: no keys, no request ids, the same arrays.
    assert template == {"prompt": prompt(), "multi_modal_data": {"video": v0}}
    assert template["multi_modal_data"]["video"] is v0
    assert [sorted(copy) for copy in copies] == [["multi_modal_data", "prompt"]] * 3
    # Four distinct keys, one prefix each, the replicas taking turns.
    keys = [key for (key,) in sent_keys]
    replicas = [int(key.removeprefix("stage0:rep")[0]) for key in keys]
    assert keys == [
        f"stage0:rep{r}:{hasher.key('video', video(s))}" for r, s in zip(replicas, range(4), strict=True)
    ]
    assert replicas[1:] == [1 - replicas[0], replicas[0], 1 - replicas[0]]

    # Retrying the template: on each replica it is keyed like a first request there.
    retries = [generate(template), generate(template)]
    assert retries == [references[0]] * 2
    h0 = hasher.key("video", v0)
    assert sorted(key for (key,) in sent_keys[4:]) == [f"stage0:rep0:{h0}", f"stage0:rep1:{h0}"]


def test_records_through_the_live_engine(
    install: Callable[..., Stage0Scoping],
    generate: Callable[[Any], Answer],
    sent_keys: list[list[str]],
    references: dict[int, Answer],
    hasher: MediaHasher,
) -> None:
    install()
    template = TextPrompt(prompt=prompt(), multi_modal_data={"video": video(0)})
    answers = [generate(template)]
    for seed in (1, 2, 3):
        answers.append(generate(attrs.evolve(template, multi_modal_data={"video": video(seed)})))
    assert answers == [references[seed] for seed in (0, 1, 2, 3)]
    assert template.scope is None
    assert [key.split(":", 2)[2] for (key,) in sent_keys] == [hasher.key("video", video(s)) for s in range(4)]


def _video_then_cached_follow_up(uuid: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A prompt with video 4 under ``uuid``, and a follow-up naming it by ``uuid`` alone (cached only)."""
    first = {
        "prompt": prompt(),
        "multi_modal_data": {"video": video(4)},
        "multi_modal_uuids": {"video": uuid},
    }
    follow_up = {
        "prompt": prompt(),
        "multi_modal_data": {"video": [None]},
        "multi_modal_uuids": {"video": [uuid]},
    }
    return first, follow_up


def test_cache_affinity_sends_a_cached_only_follow_up_where_its_item_is(
    install: Callable[..., Stage0Scoping],
    generate: Callable[[Any], Answer],
    sent_keys: list[list[str]],
    references: dict[int, Answer],
) -> None:
    install(balancer=Stage0Balancer(CacheAffinity()))
    home = CacheAffinity()(RouteRequest(None, [0, 1], ["clip-4"]))
    first, follow_up = _video_then_cached_follow_up("clip-4")
    assert generate(first) == references[4]
    assert generate(follow_up) == references[4]  # served from the replica's cache
    assert sent_keys == [[f"stage0:rep{home}:clip-4"]] * 2


def test_round_robin_sends_the_follow_up_elsewhere_and_it_fails(
    omni: Any,
    install: Callable[..., Stage0Scoping],
    generate: Callable[[Any], Answer],
    sent_keys: list[list[str]],
    references: dict[int, Answer],
) -> None:
    from vllm_omni.distributed.omni_coordinator.load_balancer import RoundRobinBalancer

    picks: list[int] = []

    class Recording(RoundRobinBalancer):  # type: ignore[misc]  # vllm-omni's own balancer, same protocol
        def select(self, task: Any, replicas: list[Any]) -> int:
            index: int = super().select(task, replicas)
            picks.append(replicas[index])
            return index

    install(balancer=Recording())
    first, follow_up = _video_then_cached_follow_up("clip-rr")
    assert generate(first) == references[4]
    # Through the engine itself: Omni.generate closes the whole engine on any error.
    params = omni.resolve_sampling_params_list(None)
    with pytest.raises(ValueError, match="Cache miss for video at index 0 but data is not provided"):
        omni.engine.add_request(request_id="follow-up-rr", prompt=follow_up, sampling_params_list=params)
    assert picks == [0, 1]
    assert sent_keys == [["stage0:rep0:clip-rr"]]  # replica 1 never got the item
    assert (
        omni.engine.stage_pools[0].get_bound_replica_id("follow-up-rr") is None
    )  # the failed request let go


def test_tenants_sharing_a_uuid_get_their_own_features(
    install: Callable[..., Stage0Scoping],
    generate: Callable[[Any], Answer],
    sent_keys: list[list[str]],
    references: dict[int, Answer],
) -> None:
    # Affinity sends equal UUIDs to the same replica: the case where a shared UUID bites.
    scoping = install(balancer=Stage0Balancer(CacheAffinity()))

    def send(seed: int, uuid: str, tenant: str | None) -> Answer:
        record = TextPrompt(
            prompt=prompt(), multi_modal_data={"video": video(seed)}, multi_modal_uuids={"video": uuid}
        )
        if tenant is not None:  # what the API server does for each tenant's request
            record = scope_to_replica(record, 0, hasher=scoping.hasher, policy=KeyPolicy(tenant=tenant))
        return generate(record)

    # Without a tenant policy the second tenant is answered with the first tenant's video.
    assert send(5, "holiday", None) == references[5]
    assert send(6, "holiday", None) == references[5] != references[6]
    # With one, each tenant's UUID is its own key.
    assert send(5, "photo", "acme") == references[5]
    assert send(6, "photo", "globex") == references[6]
    home = CacheAffinity()(RouteRequest(None, [0, 1], ["photo"]))
    assert sent_keys[2:] == [
        [f"stage0:rep{home}:tenant:acme:photo"],
        [f"stage0:rep{home}:tenant:globex:photo"],
    ]


def test_one_uuid_over_two_videos_upstream_answers_the_first_twice_ours_refuses(
    omni: Any, install: Callable[..., Stage0Scoping], generate: Callable[[Any], Answer]
) -> None:
    two, first, second = prompt(videos=2), video(5), video(6)
    right = generate({"prompt": two, "multi_modal_data": {"video": [first, second]}})
    first_twice = generate({"prompt": two, "multi_modal_data": {"video": [first, first]}})
    assert right != first_twice, "the model must tell the second video apart"

    def shared() -> dict[str, Any]:  # a new dict each time: vllm-omni 0.30 writes its keys into it
        return {
            "prompt": two,
            "multi_modal_data": {"video": [first, second]},
            "multi_modal_uuids": {"video": ["clip-2", "clip-2"]},
        }

    # vllm-omni scopes both to one key: the second video is served the first's features.
    assert generate(shared()) == first_twice

    install()
    params = omni.resolve_sampling_params_list(None)
    with pytest.raises(InvalidPromptError, match="UUID 'clip-2' also names") as caught:
        omni.engine.add_request(request_id="one-uuid", prompt=shared(), sampling_params_list=params)
    assert caught.value.path == "$.multi_modal_uuids.video[1]"
    assert omni.engine.stage_pools[0].get_bound_replica_id("one-uuid") is None
