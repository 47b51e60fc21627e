"""The installed scoping on vllm-omni 0.30's own request path (its source: ``_omni_source.py``).

vllm-omni reads a prompt as a dict from its message builder on: it writes the request's
``global_request_id`` into it, restores the omni-only fields from it after
``process_inputs``, expands it into CFG companions and keeps it for later stages. A
record used to go down that path as a record and lost all of it; CFG companions went to
the parent's replica under unscoped keys.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from PIL import Image

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    scope_to_replica,
)
from omni_requests_omni import install_stage0_scoping
from omni_requests_vllm import from_vllm, to_vllm

from ..conftest import CountingHasher as Counting
from . import _omni_source

ROOT = _omni_source.wheel()
pytestmark = pytest.mark.skipif(ROOT is None, reason="vllm-omni is not installed")
MODEL = "/models/tiny-omni"
_T = TypeVar("_T")


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)


def _engine(**kwargs: Any) -> Any:
    assert ROOT is not None
    return _omni_source.engine_type(ROOT)(**kwargs)


@pytest.mark.parametrize("shape", ["dict", "record"])
def test_a_records_omni_fields_reach_the_engine_request_as_a_dicts_do(shape: str) -> None:
    engine = _engine()
    installed = install_stage0_scoping(engine)
    plain = {
        "prompt": "<image>",
        "multi_modal_data": {"image": _pixels(1)},
        "additional_information": {"speaker": ["vivian"]},
    }
    prompt: Any = plain if shape == "dict" else from_vllm(plain)
    try:
        message = engine._build_add_request_message("req-1", prompt)
    finally:
        installed.uninstall()
    ((request_id, sent),) = engine.input_processor.calls
    replica = engine.stage_pools[0].bound["req-1"]
    assert request_id == "req-1"
    assert sent["additional_information"] == {"speaker": ["vivian"], "global_request_id": ["req-1"]}
    assert sent["multi_modal_uuids"] == {
        "image": [f"stage0:rep{replica}:{MediaHasher(MODEL).key('image', _pixels(1))}"]
    }
    # What vllm-omni restores the omni-only fields from, and keeps for later stages: dicts.
    (raw,) = engine.upgraded
    assert isinstance(raw, dict) and raw["additional_information"]["speaker"] == ["vivian"]
    assert isinstance(message.original_prompt, dict) and message.output_prompt_text == "<image>"
    # The caller's prompt is as it was.
    given = plain if shape == "dict" else to_vllm(prompt)
    assert given["additional_information"] == {"speaker": ["vivian"]} and "multi_modal_uuids" not in given


def test_a_reused_record_is_hashed_once_down_vllm_omnis_own_path() -> None:
    # The record enters as its engine dict; its images and tensors there are hand-outs
    # of its seals, which scoping reads back without a copy or a hash.
    torch = pytest.importorskip("torch")
    engine = _engine()
    installed = install_stage0_scoping(engine, hasher=Counting(MODEL))
    rng = np.random.default_rng(2)
    media = {
        "image": [Image.fromarray(_pixels(3)), _pixels(4)],
        "video": [torch.from_numpy(rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8))],
    }
    record = TextPrompt(prompt="<image><image><video>", multi_modal_data=media)
    try:
        for n in range(3):
            Counting.computed = Counter()
            engine._build_add_request_message(f"req-{n}", record)
            assert sum(Counting.computed.values()) == (3 if n == 0 else 0)
    finally:
        installed.uninstall()
    keys = [prompt["multi_modal_uuids"] for _, prompt in engine.input_processor.calls]
    bases = [{m: [k.split(":", 2)[2] for k in ks] for m, ks in found.items()} for found in keys]
    assert bases[0] == bases[1] == bases[2]


@pytest.mark.parametrize("shape", ["dict", "record"])
def test_cfg_companions_are_scoped_to_their_parents_replica(shape: str) -> None:
    # Bagel's img2img guidance: a companion with the image and a negative prompt, one
    # with neither. vllm-omni admits companions on the parent's replica.
    assert ROOT is not None
    bagel = _omni_source.module(ROOT, "model_executor/stage_input_processors/bagel.py", "_bagel_cfg")
    engine = _engine(prompt_expand_func=bagel.expand_cfg_prompts)
    installed = install_stage0_scoping(engine)
    plain = {
        "prompt": "<|fim_middle|>make it blue",
        "modalities": ["img2img"],
        "multi_modal_data": {"image": _pixels(5)},
    }
    prompt: Any = plain if shape == "dict" else from_vllm(plain)
    try:
        engine._build_add_request_message(
            "req-0", {"prompt": "warm-up"}
        )  # round robin: the next is replica 1
        engine.add_request("req-1", prompt, final_stage_id=1)  # vllm-omni's: message, then companions
        companions = engine.companions_of("req-1")
    finally:
        installed.uninstall()
    assert len(companions) == 2 and all(c.companion_id.startswith("req-1__") for c in companions)
    replica = engine.stage_pools[0].bound["req-1"]
    calls = dict(engine.input_processor.calls)
    parent_key = calls["req-1"]["multi_modal_uuids"]["image"]
    assert parent_key == [f"stage0:rep{replica}:{MediaHasher(MODEL).key('image', _pixels(5))}"]
    with_image, without = (calls[c.companion_id] for c in companions)
    assert with_image["multi_modal_uuids"] == {"image": parent_key}  # the parent's replica and key
    assert "multi_modal_data" not in without and not without.get("multi_modal_uuids")


def _photo(scope: str) -> Any:
    record = TextPrompt(
        prompt="<image>", multi_modal_data={"image": _pixels(6)}, multi_modal_uuids={"image": "photo"}
    )
    if scope == "tenant":
        return scope_to_replica(record, 1, hasher=MediaHasher(MODEL), policy=KeyPolicy(tenant="acme"))
    if scope == "bound":
        return scope_to_replica(record, 1, hasher=MediaHasher(MODEL), policy=KeyPolicy(bind_content=True))
    return scope_to_replica(record, 1, hasher=MediaHasher(MODEL))  # a retry of a scoped record


def _sent_alone(prompt: Any, transform: Any = None, live: list[int] | None = None) -> tuple[Any, int]:
    """What process_inputs got for ``prompt`` sent once as "req-1", and its replica;
    ``transform``: the model's prompt transform, if any; ``live``: stage 0's live replicas."""
    engine = _engine()
    if transform is not None:
        engine.prompt_transform_func = transform
    if live is not None:
        engine.stage_pools[0].live_replica_ids = lambda: live
    installed = install_stage0_scoping(engine)
    try:
        engine._build_add_request_message("req-1", prompt)
    finally:
        installed.uninstall()
    ((_, sent),) = engine.input_processor.calls
    return sent, engine.stage_pools[0].bound["req-1"]


@pytest.mark.parametrize("scope", ["retry", "tenant", "bound"])
def test_a_scoped_record_keeps_its_policy_down_vllm_omnis_path(scope: str) -> None:
    # Its engine dict carries rendered keys, which from_vllm refuses: the scoping reads
    # that dict back as the record, with its user UUIDs and its policy.
    record = _photo(scope)
    sent, replica = _sent_alone(record)
    want = to_vllm(scope_to_replica(record, replica, hasher=MediaHasher(MODEL)))["multi_modal_uuids"]
    assert sent["multi_modal_uuids"] == want
    if scope == "tenant":
        assert want == {"image": [f"stage0:rep{replica}:tenant:acme:photo"]}
    assert sent["additional_information"] == {"global_request_id": ["req-1"]}


@pytest.mark.parametrize("shape", ["record", "dict"])
def test_an_encoder_decoder_prompt_goes_down_vllm_omnis_path_as_a_record(shape: str) -> None:
    # vllm-omni writes additional_information at a dict's top level, where an
    # encoder-decoder dict has no place for it: the pair is scoped as a record. Given as
    # a dict, scoping refused it for that field (found by an adversarial review).
    pair = EncoderDecoderPrompt(
        encoder_prompt=TextPrompt(prompt="<image>", multi_modal_data={"image": _pixels(7)}),
        decoder_prompt=TextPrompt(prompt="hi"),
    )
    sent, replica = _sent_alone(pair if shape == "record" else to_vllm(pair))
    key = MediaHasher(MODEL).key("image", _pixels(7))
    assert sent["encoder_prompt"]["multi_modal_uuids"] == {"image": [f"stage0:rep{replica}:{key}"]}


def _img2img(policy: KeyPolicy | None) -> Any:
    record = from_vllm(
        {
            "prompt": "<|fim_middle|>make it blue",
            "modalities": ["img2img"],
            "multi_modal_data": {"image": _pixels(8)},
        }
    )
    return record if policy is None else scope_to_replica(record, 0, hasher=MediaHasher(MODEL), policy=policy)


def _bagel_engine() -> Any:
    assert ROOT is not None
    bagel = _omni_source.module(ROOT, "model_executor/stage_input_processors/bagel.py", "_bagel_cfg")
    return _engine(prompt_expand_func=bagel.expand_cfg_prompts)


def test_cfg_companions_keep_their_parents_policy() -> None:
    # A tenant_content policy keys the tenant's image apart from everyone's: its
    # companion, built from the parent's dict without the policy, went out un-tenanted.
    engine = _bagel_engine()
    installed = install_stage0_scoping(engine)
    try:
        engine.add_request("req-1", _img2img(KeyPolicy(tenant="acme", tenant_content=True)), final_stage_id=1)
        companions = engine.companions_of("req-1")
    finally:
        installed.uninstall()
    calls = dict(engine.input_processor.calls)
    parent = calls["req-1"]["multi_modal_uuids"]["image"]
    assert ":tenant:acme:" in parent[0]
    assert calls[companions[0].companion_id]["multi_modal_uuids"] == {"image": parent}


def test_a_scoped_record_survives_a_transform_that_copies_the_prompt_deeply() -> None:
    engine = _engine()
    engine.prompt_transform_func = lambda prompt, _: copy.deepcopy(prompt)
    installed = install_stage0_scoping(engine)
    try:
        engine._build_add_request_message("req-1", _photo("tenant"))
    finally:
        installed.uninstall()
    ((_, sent),) = engine.input_processor.calls
    replica = engine.stage_pools[0].bound["req-1"]
    assert sent["multi_modal_uuids"] == {"image": [f"stage0:rep{replica}:tenant:acme:photo"]}


@pytest.mark.parametrize("given", ["the same image", "another image"])
def test_a_transform_that_drops_a_records_uuids_keeps_its_tenants_policy(given: str) -> None:
    # A prompt transform that rebuilt the dict without multi_modal_uuids (MiniMax-H3's
    # replaces multi_modal_data wholesale) left a dict no scoped record matched: it was
    # scoped as a plain dict, and the tenant's image went out under everyone's key
    # (found by an adversarial review). It is scoped under the request's policy now.
    policy = KeyPolicy(tenant="acme", tenant_content=True)
    record = scope_to_replica(
        TextPrompt(prompt="<image>", multi_modal_data={"image": _pixels(3)}),
        0,
        hasher=MediaHasher(MODEL),
        policy=policy,
    )
    pixels = _pixels(3 if given == "the same image" else 4)

    def rebuilt(prompt: Any, _: Any) -> dict[str, Any]:
        return {"prompt": prompt["prompt"], "multi_modal_data": {"image": pixels}}

    sent, replica = _sent_alone(record, rebuilt)
    key = MediaHasher(MODEL).key("image", pixels)
    assert sent["multi_modal_uuids"] == {"image": [f"stage0:rep{replica}:tenant:acme:{key}"]}


def _two_tenants() -> list[Any]:
    return [
        scope_to_replica(
            TextPrompt(prompt="<image>", multi_modal_data={"image": _pixels(seed)}),
            0,
            hasher=MediaHasher(MODEL),
            policy=KeyPolicy(tenant=tenant, tenant_content=True),
        )
        for seed, tenant in ((3, "acme"), (4, "globex"))
    ]


def test_a_transform_that_gives_records_under_two_policies_new_media_is_refused() -> None:
    # No one policy to keep: refused by name rather than sent under none.
    def rebuilt(prompt: Any, _: Any) -> Any:
        return [{"prompt": item["prompt"], "multi_modal_data": {"image": _pixels(9)}} for item in prompt]

    with pytest.raises(InvalidPromptError, match="different key policies") as caught:
        _sent_alone(_two_tenants(), rebuilt)
    assert caught.value.path == "$.multi_modal_uuids"


@pytest.mark.parametrize("copied", ["shallow", "deep"])
def test_a_transform_that_rebuilds_records_dicts_keeps_each_records_policy(copied: str) -> None:
    # Each dict still holds its record's media (the same objects, or deep copies of them):
    # it is that record's, whatever else the transform rebuilt.
    def rebuilt(prompt: Any, _: Any) -> Any:
        return [
            {"prompt": item["prompt"], "multi_modal_data": copy.deepcopy(item["multi_modal_data"])}
            if copied == "deep"
            else {"prompt": item["prompt"], "multi_modal_data": item["multi_modal_data"]}
            for item in prompt
        ]

    records = _two_tenants()
    sent, replica = _sent_alone(records, rebuilt)
    want = [to_vllm(scope_to_replica(record, replica, hasher=MediaHasher(MODEL))) for record in records]
    assert [item["multi_modal_uuids"] for item in sent] == [item["multi_modal_uuids"] for item in want]
    assert ":tenant:globex:" in sent[1]["multi_modal_uuids"]["image"][0]


def test_a_request_id_sent_again_unscoped_never_gets_its_old_replica_for_companions() -> None:
    engine = _bagel_engine()
    installed = install_stage0_scoping(engine)
    try:
        engine._build_add_request_message("req-1", _img2img(None))  # scoped; no companions built
        engine.stage_pools[0].live_replica_ids = lambda: [0]  # one replica left: nothing is scoped
        engine.add_request("req-1", _img2img(None), final_stage_id=1)
        companions = engine.companions_of("req-1")
    finally:
        installed.uninstall()
    calls = [
        prompt
        for request_id, prompt in engine.input_processor.calls
        if request_id == companions[0].companion_id
    ]
    assert calls and not calls[0].get("multi_modal_uuids")


class _Paused:
    """An engine whose request sent from a thread named "A" pauses between its scoping and
    its process_inputs until ``resume`` is set; ``a_scoped`` is set when it gets there."""

    def __init__(self) -> None:
        assert ROOT is not None
        self.a_scoped, self.resume = threading.Event(), threading.Event()
        self.errors: list[BaseException] = []
        paused = threading.local()
        resume = self.resume

        class Pausing(_omni_source.engine_type(ROOT)):  # type: ignore[misc]
            @property
            def input_processor(self) -> Any:
                if getattr(paused, "after_scoping", False):
                    paused.after_scoping = False
                    assert resume.wait(30)
                return self._processor

            @input_processor.setter
            def input_processor(self, processor: Any) -> None:
                self._processor = processor

        self.engine = Pausing()
        self.installed = install_stage0_scoping(self.engine)
        scope = self.engine._scope_stage0_multimodal_cache_to_replica

        def scope_then_pause(request_id: str, prompt: Any) -> Any:
            replica = scope(request_id, prompt)
            if threading.current_thread().name == "A":
                paused.after_scoping = True
                self.a_scoped.set()
            return replica

        self.engine._scope_stage0_multimodal_cache_to_replica = scope_then_pause

    def send(self, name: str, request_id: str, prompt: Any) -> threading.Thread:
        def run() -> None:
            try:
                self.engine._build_add_request_message(request_id, prompt)
            except BaseException as error:  # noqa: BLE001 - reported by the test
                self.errors.append(error)
                self.a_scoped.set()

        thread = threading.Thread(target=run, name=name)
        thread.start()
        return thread


def _assert_scoped_as_sent(got: list[Any], sent: dict[str, Any]) -> list[str]:
    """Each prompt process_inputs got carries the keys of its own media, scoped; the
    names of the requests whose media they are."""
    names = []
    for prompt in got:
        (image,) = prompt["multi_modal_data"]["image"]
        (key,) = prompt["multi_modal_uuids"]["image"]
        name = next(
            n for n in sent if np.array_equal(np.asarray(image), sent[n]["multi_modal_data"]["image"])
        )
        replica = int(key.split(":")[1].removeprefix("rep"))
        alone = scope_to_replica(from_vllm(sent[name]), replica, hasher=MediaHasher(MODEL))
        assert prompt["multi_modal_uuids"] == to_vllm(alone)["multi_modal_uuids"]
        names.append(name)
    return names


def _image_prompts(*names: str) -> dict[str, Any]:
    return {
        name: {"prompt": "<image>", "multi_modal_data": {"image": _pixels(seed)}}
        for seed, name in enumerate(names, 1)
    }


def test_two_requests_sharing_an_id_in_flight_each_get_their_own_scoped_prompt() -> None:
    # The scoping handed its scoped prompt to process_inputs through a dict keyed by
    # request id: a second request with the same id, scoped in between, took its place,
    # so one request reached process_inputs unscoped, or with the other's media (found
    # by an adversarial review, helper-59). Request A pauses between its scoping and its
    # process_inputs while B, with A's id, goes all the way through.
    paused, sent = _Paused(), _image_prompts("A", "B")
    try:
        first = paused.send("A", "same-id", sent["A"])
        assert paused.a_scoped.wait(30)
        paused.send("B", "same-id", sent["B"]).join(30)
        paused.resume.set()
        first.join(30)
    finally:
        paused.resume.set()
        paused.installed.uninstall()
    assert not paused.errors
    got = [prompt for _, prompt in paused.engine.input_processor.calls]
    assert sorted(_assert_scoped_as_sent(got, sent)) == ["A", "B"]  # each its own media, once


def _while_a_is_paused(during: Callable[[_Paused], _T]) -> tuple[_Paused, dict[str, Any], _T]:
    """``during(paused)`` run while request A waits between its scoping and its
    process_inputs; A is through when this returns."""
    paused, sent = _Paused(), _image_prompts("A")
    first = paused.send("A", "req-a", sent["A"])
    try:
        assert paused.a_scoped.wait(30)
        result = during(paused)
    finally:
        paused.resume.set()
        first.join(30)
    assert not paused.errors
    return paused, sent, result


def test_uninstalling_while_a_request_is_in_flight_lets_it_finish_scoped() -> None:
    # uninstall() gave the processor its own process_inputs back at once: a request
    # between its scoping and its process_inputs reached it without its scoped prompt,
    # its media under unscoped keys on the replica it was bound to (found by a review,
    # helper-60). process_inputs goes back when the request is through.
    def uninstall(paused: _Paused) -> tuple[bool, bool]:
        paused.installed.uninstall()
        engine_own = "_build_add_request_message" not in paused.engine.__dict__  # for new requests
        return engine_own, "process_inputs" in paused.engine.input_processor.__dict__

    paused, sent, (engine_own, still_ours) = _while_a_is_paused(uninstall)
    processor = paused.engine.input_processor
    assert engine_own and still_ours  # not yet: A was in flight
    assert "process_inputs" not in processor.__dict__  # given back once A was through
    assert _assert_scoped_as_sent([prompt for _, prompt in processor.calls], sent) == ["A"]


def test_an_installation_made_while_an_uninstall_waits_goes_onto_the_engines_own() -> None:
    # The first installation gives process_inputs back when its last request is through:
    # it must not take off the wrapper of an installation made meanwhile, nor stay under
    # it (its wrapper scoped CFG companions a second time, and was given back for good by
    # the second's uninstall; found by a review, helper-61).
    def uninstall_and_install(paused: _Paused) -> Any:
        paused.installed.uninstall()
        return install_stage0_scoping(paused.engine)

    paused, sent, again = _while_a_is_paused(uninstall_and_install)
    processor = paused.engine.input_processor
    try:
        assert processor.__dict__["process_inputs"] == again.process_inputs
        assert again._process_inputs == type(processor).process_inputs.__get__(processor)  # the engine's own
    finally:
        again.uninstall()
    assert "process_inputs" not in processor.__dict__  # the engine's own, as before both
    assert _assert_scoped_as_sent([prompt for _, prompt in processor.calls], sent) == ["A"]  # A, scoped


def test_a_handle_installed_again_while_its_uninstall_waits_stays_installed() -> None:
    # Its waiting uninstall gave process_inputs back once the request in flight was
    # through, from under the handle installed again: new requests were scoped by its
    # helper and reached the engine's own process_inputs without their scoped prompt.
    def uninstall_and_install_again(paused: _Paused) -> None:
        paused.installed.uninstall()
        paused.installed.install()

    paused, sent, _ = _while_a_is_paused(uninstall_and_install_again)
    processor = paused.engine.input_processor
    try:
        assert processor.__dict__["process_inputs"] == paused.installed.process_inputs
    finally:
        paused.installed.uninstall()
    assert "process_inputs" not in processor.__dict__
    assert _assert_scoped_as_sent([prompt for _, prompt in processor.calls], sent) == ["A"]


def test_an_install_and_uninstall_while_an_uninstall_waits_leave_the_request_in_flight_scoped() -> None:
    # The second installation, made and uninstalled while the first's uninstall waited
    # for request A, gave the processor the engine's own process_inputs back: A then
    # reached it without its scoped prompt (found by a review, helper-63).
    def uninstall_install_uninstall(paused: _Paused) -> None:
        paused.installed.uninstall()
        install_stage0_scoping(paused.engine).uninstall()

    paused, sent, _ = _while_a_is_paused(uninstall_install_uninstall)
    processor = paused.engine.input_processor
    assert _assert_scoped_as_sent([prompt for _, prompt in processor.calls], sent) == ["A"]
    assert "process_inputs" not in processor.__dict__  # the engine's own once A was through


def _tenant_img2img(seed: int, tenant: str | None) -> Any:
    record = from_vllm(
        {
            "prompt": "<|fim_middle|>make it blue",
            "modalities": ["img2img"],
            "multi_modal_data": {"image": _pixels(seed)},
            "multi_modal_uuids": {"image": f"photo-{seed}"},
        }
    )
    policy = None if tenant is None else KeyPolicy(tenant=tenant, tenant_content=True)
    return scope_to_replica(record, 1, hasher=MediaHasher(MODEL), policy=policy)


def _keys_sent(engine: Any) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for request_id, prompt in engine.input_processor.calls:
        found.setdefault(request_id, []).append((prompt.get("multi_modal_uuids") or {}).get("image"))
    return found


def test_cfg_companions_of_two_requests_sharing_an_id_keep_their_own_parent() -> None:
    # A parent's replica and policy were kept for its companions by request id: built
    # after a second request with the same id, A's companion went out under B's replica
    # and tenant, B's without a key (found by a review, helper-63). vllm-omni builds the
    # companions from the message's original_prompt, which tells them apart.
    engine = _bagel_engine()
    installed = install_stage0_scoping(engine)
    try:
        first = engine._build_add_request_message("x", _tenant_img2img(1, "acme"), final_stage_id=1)
        second = engine._build_add_request_message("x", _tenant_img2img(2, "globex"), final_stage_id=1)
        for message in (second, first):
            engine._build_cfg_companions("x", message.original_prompt, object(), [object()])
    finally:
        installed.uninstall()
    parents, companions = _keys_sent(engine)["x"], _keys_sent(engine)["x__cfg_text"]
    assert parents[0][0].endswith(":tenant:acme:photo-1") and parents[1][0].endswith(":tenant:globex:photo-2")
    assert companions == [parents[1], parents[0]]  # each its own parent's replica and tenant


@pytest.mark.parametrize("tenant", ["acme", None])
def test_a_companion_copying_its_scoped_parents_dict_goes_out_with_its_parents_keys(
    tenant: str | None,
) -> None:
    # audex's and MiniMax-Music's expansions copy the parent dict ({**prompt, ...}): it
    # held the record's rendered keys, which the companion's scoping refused as already
    # scoped, failing the request (found by a review, helper-63).
    assert ROOT is not None
    bagel = _omni_source.module(ROOT, "model_executor/stage_input_processors/bagel.py", "_bagel_cfg")
    kept: list[Any] = []

    def expand(prompt: Any, _: Any) -> list[Any]:
        kept.append(copy.deepcopy(prompt["multi_modal_uuids"]))
        companion = {**prompt, "prompt": "<|fim_middle|>"}
        return [bagel.ExpandedPrompt(prompt=companion, role="uncond", request_id_suffix="__uncond")]

    parent = _tenant_img2img(3, tenant)  # scoped to replica 1 before: a tenant's record, or a retry
    engine = _engine(prompt_expand_func=expand)
    installed = install_stage0_scoping(engine)
    try:
        engine.add_request("req-1", parent, final_stage_id=1)
    finally:
        installed.uninstall()
    sent = _keys_sent(engine)
    replica = engine.stage_pools[0].bound["req-1"]
    want = to_vllm(scope_to_replica(parent, replica, hasher=MediaHasher(MODEL)))["multi_modal_uuids"]
    assert sent["req-1"] == [want["image"]] and sent["req-1__uncond"] == sent["req-1"]
    # What vllm-omni keeps of the request: the caller's UUIDs, never the old scope's keys.
    assert kept == [{"image": ["photo-3"]}]


def test_a_stale_copy_of_a_records_dict_beside_it_in_a_batch_is_refused() -> None:
    # It was read back as the record (equal UUIDs), its new image going out under the
    # record's key; scope_stage0 alone refuses it (found by a review, helper-63).
    record = _photo("retry")
    stale = dict(to_vllm(record), multi_modal_data={"image": _pixels(9)})
    engine = _engine()
    installed = install_stage0_scoping(engine)
    try:
        with pytest.raises(InvalidPromptError, match="already scoped to a replica") as caught:
            engine._build_add_request_message("req-1", [record, stale])
    finally:
        installed.uninstall()
    assert caught.value.path == "$[1].multi_modal_uuids.image[0]"
    assert not engine.input_processor.calls


def test_a_plain_dict_beside_a_tenants_record_is_keyed_as_scope_stage0_keys_it() -> None:
    # The caller's own dict was keyed under the tenant of the record beside it (found by
    # a review, helper-63); scope_stage0 keys it under no policy.
    record = _tenant_img2img(4, "acme")
    plain = {"prompt": "<image>", "multi_modal_data": {"image": _pixels(5)}}
    sent, replica = _sent_alone([record, plain])
    hasher = MediaHasher(MODEL)
    want = [to_vllm(scope_to_replica(one, replica, hasher=hasher)) for one in (record, from_vllm(plain))]
    assert [item["multi_modal_uuids"] for item in sent] == [item["multi_modal_uuids"] for item in want]
    assert "tenant" not in sent[1]["multi_modal_uuids"]["image"][0]


def test_engines_sharing_a_processor_scope_each_cfg_companion_once() -> None:
    # A companion went through both installations' wrappers and was scoped by each, then
    # refused as already scoped (found by a review, helper-63).
    engines = [_bagel_engine(), _bagel_engine()]
    engines[1].input_processor = engines[0].input_processor
    installed = [install_stage0_scoping(engine) for engine in engines]
    try:
        engines[0].add_request("req-1", _img2img(None), final_stage_id=1)
    finally:
        for one in installed:
            one.uninstall()
    sent = _keys_sent(engines[0])
    assert sent["req-1__cfg_text"] == sent["req-1"] and sent["req-1"][0][0].startswith("stage0:rep")


def test_a_tenants_record_scoped_before_goes_to_the_one_live_replica_under_its_key() -> None:
    # It reached process_inputs in its old scope, replica 1's key on replica 0 (found by a
    # review, helper-63).
    sent, _ = _sent_alone(_tenant_img2img(6, "acme"), live=[0])
    assert sent["multi_modal_uuids"] == {"image": ["stage0:rep0:tenant:acme:photo-6"]}


def test_a_deep_copy_of_two_tenants_records_that_look_alike_is_refused_not_merged() -> None:
    # Equal media and UUIDs under two tenants: a deep-copying transform's dicts matched
    # the first record twice, globex's image going out under acme's key (found by a
    # review, helper-71). Which is which cannot be told: refused by name.
    records = [
        scope_to_replica(
            TextPrompt(
                prompt="<image>", multi_modal_data={"image": _pixels(3)}, multi_modal_uuids={"image": "photo"}
            ),
            0,
            hasher=MediaHasher(MODEL),
            policy=KeyPolicy(tenant=tenant, tenant_content=True),
        )
        for tenant in ("acme", "globex")
    ]
    sent, _ = _sent_alone(records)  # no transform: each its own
    assert [item["multi_modal_uuids"]["image"][0].split(":")[3] for item in sent] == ["acme", "globex"]
    with pytest.raises(InvalidPromptError, match="which is which cannot be told") as caught:
        _sent_alone(records, lambda prompt, _: copy.deepcopy(prompt))
    assert caught.value.path == "$.multi_modal_uuids"
    plain = to_vllm(
        TextPrompt(
            prompt="<image>", multi_modal_data={"image": _pixels(3)}, multi_modal_uuids={"image": "photo"}
        )
    )
    with pytest.raises(InvalidPromptError, match="which is which cannot be told"):
        _sent_alone([records[0], plain], lambda prompt, _: copy.deepcopy(prompt))  # a dict of yours beside it


def test_a_uuid_row_that_is_an_array_in_a_deep_copy_is_refused_by_name() -> None:
    # Compared with a record's UUIDs, it raised numpy's ValueError (found by helper-71).
    two = {"image": [_pixels(4), _pixels(5)]}
    record = scope_to_replica(
        TextPrompt(prompt="<image><image>", multi_modal_data=two, multi_modal_uuids={"image": ["a", "b"]}),
        1,
        hasher=MediaHasher(MODEL),
    )
    rows = {"image": np.array(["c", "d"])}
    given = [record, {"prompt": "<image><image>", "multi_modal_data": two, "multi_modal_uuids": rows}]
    with pytest.raises(PromptTypeError) as caught:
        _sent_alone(given, lambda prompt, _: copy.deepcopy(prompt))
    assert caught.value.path == "$[1].multi_modal_uuids.image"


def test_a_streaming_update_keeps_no_parent_for_companions() -> None:
    # vllm-omni's add_streaming_update builds no companions: its parent entry held the
    # request's media until 64 others pushed it out (found by helper-71).
    engine = _bagel_engine()
    installed = install_stage0_scoping(engine)
    try:
        for n in range(3):
            engine._build_add_request_message(
                f"req-{n}", _img2img(None), final_stage_id=1, message_type="streaming_update"
            )
        assert installed._parents == {}
        engine.add_request("req-9", _img2img(None), final_stage_id=1)  # built and used at once
        assert installed._parents == {}
    finally:
        installed.uninstall()


def test_a_refused_request_leaves_no_folder_of_the_models_prompt_transform(tmp_path: Any) -> None:
    # vllm-omni lists the folders a model's prompt transform made for a request in the
    # prompt its message builder is given, and add_request removes them when the
    # request fails. Installed, that prompt is our copy, which add_request never sees:
    # every request the scoping refused left its folders on disk (found by a review,
    # helper-85), and a client can have requests refused at will.
    assert ROOT is not None
    key = _omni_source.module(ROOT, "data_entry_keys.py", "_omni_data_entry_keys").REQUEST_ARTIFACT_DIRS_KEY
    made: list[Any] = []

    def transform(prompt: dict[str, Any], _: object) -> dict[str, Any]:
        folder = tmp_path / f"request-{len(made)}"
        folder.mkdir()
        made.append(folder)
        prompt[key] = [str(folder)]
        return prompt

    refused = {
        "prompt": "<image><image>",
        "multi_modal_data": {"image": [_pixels(1), _pixels(2)]},
        "multi_modal_uuids": {"image": ["clip", "clip"]},  # one UUID over two images
    }
    for install in (False, True):  # vllm-omni alone (its stand-in helper raises), then ours
        engine = _engine()
        engine.prompt_transform_func = transform
        installed = install_stage0_scoping(engine) if install else None
        with pytest.raises(AssertionError if installed is None else InvalidPromptError):
            engine.add_request("req-1", copy.deepcopy(refused), final_stage_id=1)
        assert not made[-1].exists()
        if installed is not None:
            installed.uninstall()
    assert len(made) == 2
