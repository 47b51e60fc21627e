"""Routing plus conversion hash each media item at most once per request.

``CacheAffinity`` reads a request's media keys to route it; the request's dicts then carry
the same keys, scoped. A PIL image or a tensor in a dict has no cached key (nothing stops
writes to it), so without reuse inside the request it was hashed twice; a record's are
sealed, keyed once and never again. These tests count the digests a ``MediaHasher``
computes, per item, for a PIL image, a tensor and an array, in dicts and in records,
through ``scope_stage0`` and through the scoping installed into an engine, and check that
the keys are exactly ``scope_to_replica``'s (policies included).
"""

from __future__ import annotations

import contextvars
import enum
import random
import types
from collections import Counter
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omni_requests import (
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    OmniRequestsError,
    PromptTypeError,
    TextPrompt,
    scope_to_replica,
)
from omni_requests._records import values_equal
from omni_requests_omni import (
    CacheAffinity,
    RoundRobin,
    RouteRequest,
    Stage0Balancer,
    Stage0Pool,
    install_stage0_scoping,
    scope_stage0,
)
from omni_requests_vllm import to_vllm

from ..conftest import CountingHasher as Counting
from . import _omni_source

MODEL = "/models/tiny-omni"
PLAIN = MediaHasher(MODEL)


def _hasher() -> Counting:
    Counting.computed = Counter()
    return Counting(MODEL)


def _media(seed: int) -> dict[str, list[Any]]:
    """One PIL image, one array image and one tensor video, all never seen before."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    return {
        "image": [Image.fromarray(pixels), rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)],
        "video": [torch.from_numpy(rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8))],
    }


def _content_keys(media: dict[str, list[Any]]) -> Counter[str]:
    """Each item's content key once: what one hash per item computes."""
    return Counter(PLAIN.content_key(modality, item) for modality, items in media.items() for item in items)


class Capturing:
    """CacheAffinity, also keeping the context it ran in (as a task started there would)."""

    def __init__(self) -> None:
        self.policy = CacheAffinity()
        self.context: contextvars.Context | None = None

    def __call__(self, request: RouteRequest) -> int | None:
        self.context = contextvars.copy_context()
        return self.policy(request)


def _expected(record: TextPrompt, replica: int) -> Any:
    return to_vllm(scope_to_replica(record, replica, hasher=PLAIN))


def _same(sent: Any, expected: Any) -> bool:
    """The same dict: equal keys and fields, the same media (by value: a dict's arrays are
    copies, a record's images and tensors fresh hand-outs)."""
    data, want = sent.pop("multi_modal_data"), expected.pop("multi_modal_data")
    same_media = data.keys() == want.keys() and all(
        len(data[m]) == len(want[m])
        and all(
            a is b or values_equal(a, b)  # a record's image or tensor goes out as a fresh hand-out
            for a, b in zip(data[m], want[m], strict=True)
        )
        for m in data
    )
    return same_media and sent == expected


def _check_nothing_is_reused_after(
    media: dict[str, list[Any]], capturing: Capturing, hasher: Counting
) -> None:
    """After the request, a changed image gets its new key, even in a context copied during it."""
    image = media["image"][0]
    image.putpixel((0, 0), tuple(255 - v for v in image.getpixel((0, 0))))
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": image})
    assert capturing.context is not None
    out = capturing.context.run(lambda: to_vllm(scope_to_replica(record, 1, hasher=hasher)))
    assert out["multi_modal_uuids"]["image"] == [f"stage0:rep1:{PLAIN.content_key('image', image)}"]


@pytest.mark.parametrize("many", [False, True], ids=["one prompt", "a list of prompts"])
def test_a_dict_request_hashes_each_item_once(many: bool) -> None:
    hasher, capturing = _hasher(), Capturing()
    media = _media(1)
    prompt: dict[str, Any] = {"prompt": "<image><image><video>", "multi_modal_data": media}
    given: Any = [prompt, {"prompt": "no media"}] if many else prompt
    replica, out = scope_stage0(given, pool=Stage0Pool(replicas=2, select=capturing), hasher=hasher)
    assert replica is not None
    assert Counting.computed == _content_keys(media)  # every item hashed, each exactly once
    scoped = out[0] if many else out
    assert scoped["multi_modal_uuids"] == _expected(TextPrompt(**prompt), replica)["multi_modal_uuids"]

    # The next request with the same (unchanged) dict hashes its image and tensor again:
    # there is no cache across requests for them; its array is a new copy, hashed again too.
    Counting.computed = Counter()
    scope_stage0(given, pool=Stage0Pool(replicas=2, select=capturing), hasher=hasher)
    assert Counting.computed == _content_keys(media)
    _check_nothing_is_reused_after(media, capturing, hasher)


@pytest.mark.parametrize("shared", ["items", "whole values"])
def test_one_caller_object_in_several_dicts_of_a_request_is_hashed_once(shared: str) -> None:
    # Each dict's record copied the caller's array (and split its tensor into fresh rows)
    # on its own, so the request's reuse, keyed by item, missed: one hash per dict.
    torch = pytest.importorskip("torch")
    hasher = _hasher()
    rng = np.random.default_rng(3)
    media: dict[str, Any]
    if shared == "items":  # the same objects in new lists
        items = _media(3)
        media = {m: list(v) for m, v in items.items()}
    else:  # vLLM reads a 3-D tensor under image as two items (embeddings), split here
        items = media = {
            "image": torch.from_numpy(rng.integers(0, 256, (2, 5, 7), dtype=np.uint8)),
            "video": rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8),
        }
    prompts = [
        {
            "prompt": f"<image> {n}",
            "multi_modal_data": {m: list(v) for m, v in items.items()} if shared == "items" else media,
        }
        for n in range(3)
    ]
    replica, out = scope_stage0(prompts, pool=Stage0Pool(replicas=2, select=lambda r: 1), hasher=hasher)
    assert replica == 1
    record = TextPrompt(prompt="x", multi_modal_data=media)
    assert Counting.computed == _content_keys({m: list(v) for m, v in record.multi_modal_data.items()})
    expected = _expected(record, 1)["multi_modal_uuids"]
    assert sum(map(len, expected.values())) == 3
    assert all(scoped["multi_modal_uuids"] == expected for scoped in out)


@pytest.mark.parametrize(
    "policy",
    [None, KeyPolicy(namespaces=True, tenant="acme"), KeyPolicy(bind_content=True)],
    ids=["no policy", "tenant", "bind_content"],
)
def test_a_record_request_converted_in_the_call_hashes_each_item_once(policy: KeyPolicy | None) -> None:
    hasher, capturing = _hasher(), Capturing()
    media = _media(2)
    record = TextPrompt(
        prompt="<image><image><image><video>",
        multi_modal_data={"image": [*media["image"], np.zeros((4, 4, 3), np.uint8)], "video": media["video"]},
        multi_modal_uuids={"image": [None, None, "cat"], "video": [None]},
    )
    if policy is not None:  # scoped once under a policy: every later scoping keeps it
        record = scope_to_replica(record, 0, hasher=PLAIN, policy=policy)
    Counting.computed = Counter()
    pool = Stage0Pool(replicas=2, select=capturing)
    replica, out = scope_stage0(record, pool=pool, hasher=hasher, as_dicts=True)
    assert replica is not None and isinstance(out, dict)
    assert Counting.computed == _content_keys(media)  # "cat" is a user key: never hashed
    assert _same(out, _expected(record, replica))  # the whole dict, keys and policy included
    assert out["multi_modal_uuids"]["image"][2].endswith("cat")
    # Handed back as a record instead, it is rendered by a later to_vllm, outside the
    # request: nothing is hashed again, there or in the next request. The record's array
    # is immutable and its image and tensor are sealed, so their keys are cached.
    Counting.computed = Counter()
    _, scoped = scope_stage0(record, pool=pool, hasher=hasher)
    assert _same(to_vllm(scoped), _expected(record, replica))
    scope_stage0(record, pool=pool, hasher=hasher, as_dicts=True)
    assert Counting.computed == Counter()
    _check_nothing_is_reused_after(media, capturing, hasher)


class _Pool:
    """A local stage-0 pool of two, as vllm-omni's StagePool shows itself to the scoping."""

    stage_type = "llm"
    is_distributed = False

    def __init__(self) -> None:
        self.clients = ["tcp://replica-0", "tcp://replica-1"]
        self.bound: dict[str, str] = {}
        self._lb: Any = None  # vllm-omni 0.30's StagePool's name for its attached balancer

    @staticmethod
    def _client_input_addr(client: str) -> str:
        return client

    def live_replica_ids(self) -> list[int]:
        return [0, 1]

    def available_replica_ids(self) -> list[int]:
        return [0, 1]

    def get_replica_id_by_addr(self, address: str) -> int:
        return self.clients.index(address)

    def bind(self, request_id: str, address: str) -> None:
        self.bound[request_id] = address

    def get_bound_replica_id(self, request_id: str) -> int | None:
        address = self.bound.get(request_id)
        return None if address is None else self.get_replica_id_by_addr(address)

    def attach_load_balancer(self, balancer: Any) -> None:
        self._lb = balancer


class _Processor:
    def __init__(self) -> None:
        self.received: list[Any] = []

    def process_inputs(self, *, request_id: str, prompt: Any) -> Any:
        self.received.append(prompt)
        return prompt


class _Engine:
    """The attributes of vllm-omni's AsyncOmniEngine the installation uses, and its request path."""

    model = MODEL

    def __init__(self) -> None:
        self.stage_pools = [_Pool()]
        self.input_processor = _Processor()

    def _resolve_mm_hasher_algorithm(self) -> str:
        return "blake3"

    def _build_add_request_message(self, request_id: str, prompt: Any) -> Any:
        return prompt

    def _scope_stage0_multimodal_cache_to_replica(self, request_id: str, prompt: Any) -> int | None:
        raise AssertionError("the installed scoping replaces this")

    def add_request(self, request_id: str, prompt: Any) -> tuple[int | None, Any]:
        prompt = self._build_add_request_message(request_id, prompt)
        replica = self._scope_stage0_multimodal_cache_to_replica(request_id, prompt)
        return replica, self.input_processor.process_inputs(request_id=request_id, prompt=prompt)


@pytest.mark.parametrize("shape", ["record", "dict"])
def test_the_installed_scoping_hashes_each_item_once_per_request(shape: str) -> None:
    hasher = _hasher()
    engine = _Engine()
    installed = install_stage0_scoping(engine, hasher=hasher, balancer=Stage0Balancer(CacheAffinity()))
    media = _media(3)
    record = TextPrompt(prompt="<image><image><video>", multi_modal_data=media)
    prompt: Any = record if shape == "record" else {"prompt": record.prompt, "multi_modal_data": media}
    try:
        for n in range(2):  # and again for a second request
            Counting.computed = Counter()
            replica, sent = engine.add_request(f"req-{n}", prompt)
            assert replica is not None and engine.stage_pools[0].bound[f"req-{n}"].endswith(str(replica))
            # A dict's items are hashed in every request (each is the caller's object, or
            # a new copy of its array); a record's keep the keys the first request cached.
            expected = Counter() if n and shape == "record" else _content_keys(media)
            assert Counting.computed == expected
            assert _same(sent, _expected(record, replica))
    finally:
        installed.uninstall()


def test_a_bound_request_stays_on_its_replica_when_the_balancer_would_pick_another() -> None:
    # A streaming update goes down the message builder again under its request's id:
    # the balancer, asked again, sent it to another replica than the one holding the
    # request (vllm-omni's own select_replica_id keeps a bound request where it is;
    # found by a review, helper-60).
    engine = _Engine()
    installed = install_stage0_scoping(
        engine, hasher=MediaHasher(MODEL), balancer=Stage0Balancer(RoundRobin())
    )
    record = TextPrompt(prompt="<image><image>", multi_modal_data={"image": _media(7)["image"]})
    try:
        first, sent = engine.add_request("stream-1", record)
        update, sent_again = engine.add_request("stream-1", record)
        other, _ = engine.add_request("stream-2", record)
    finally:
        installed.uninstall()
    assert first is not None and update == first and other != first  # round robin for a new id
    assert sent_again["multi_modal_uuids"] == sent["multi_modal_uuids"]
    assert sent["multi_modal_uuids"]["image"][0].startswith(f"stage0:rep{first}:")


@pytest.mark.parametrize("flag", ["false", 1, None])
def test_as_dicts_must_be_a_bool(flag: object) -> None:
    prompt = {"prompt": "<image>", "multi_modal_data": {"image": np.zeros((2, 2, 3), np.uint8)}}
    with pytest.raises(PromptTypeError, match="must be a bool") as caught:
        scope_stage0(prompt, pool=Stage0Pool(replicas=2, select=lambda _: 1), hasher=PLAIN, as_dicts=flag)  # type: ignore[call-overload]
    assert caught.value.path == "as_dicts"


@pytest.mark.parametrize("request_id", [5, b"r1", ["r1"]])
def test_request_id_must_be_a_str_or_none(request_id: object) -> None:
    # A policy is told it as RouteRequest.request_id; it was passed on whatever it was.
    prompt = {"prompt": "<image>", "multi_modal_data": {"image": np.zeros((2, 2, 3), np.uint8)}}
    pool = Stage0Pool(replicas=2, select=lambda _: 1)
    with pytest.raises(PromptTypeError, match=r"^request_id: must be a str or None") as caught:
        scope_stage0(prompt, pool=pool, hasher=PLAIN, request_id=request_id)  # type: ignore[arg-type]
    assert caught.value.path == "request_id"
    assert scope_stage0(prompt, pool=pool, hasher=PLAIN, request_id="r1").replica_id == 1


class _DistributedPool(_Pool):
    """A distributed stage-0 pool as vllm-omni 0.30's StagePool shows itself: its
    ``preselect_replica_id`` asks the attached balancer over the serviceable replicas
    (none: ``None``, the request is routed later), or picks alone without one."""

    is_distributed = True

    def __init__(self, serviceable: list[int]) -> None:
        super().__init__()
        self.serviceable = serviceable
        self.tasks: list[dict[str, Any]] = []

    def preselect_replica_id(self, request_id: str, task: dict[str, Any] | None = None) -> int | None:
        self.tasks.append(dict(task or {}))
        if not self.serviceable:
            return None
        if self._lb is None:
            return self.serviceable[-1]
        return self.serviceable[self._lb.select(task, self.serviceable)]


def _wheel_balancer(name: str) -> Any:
    """vllm-omni's own balancer ``name``: its ``select`` as the installed wheel has it (its
    module imports vllm-omni's messages, which need more than this environment has)."""
    root = _omni_source.wheel()
    if root is None:
        pytest.skip("vllm-omni is not installed")
    names: dict[str, Any] = {"random": random}
    exec(_omni_source._function(root, "distributed/omni_coordinator/load_balancer.py", "select", name), names)
    return type(name, (), {"select": names["select"]})()


def test_a_balancer_that_reads_replica_infos_is_named_on_a_local_pool() -> None:
    # A local pool's replicas reach the balancer as int ids; vllm-omni's own
    # LeastQueueLengthBalancer reads each one's queue_length and failed every media
    # request with a bare AttributeError (found by a review, helper-85).
    engine = _Engine()
    installed = install_stage0_scoping(
        engine, hasher=MediaHasher(MODEL), balancer=_wheel_balancer("LeastQueueLengthBalancer")
    )
    try:
        # The server's set-up, not the request's: no error of ours, which says bad input.
        with pytest.raises(TypeError, match=r"^balancer: .*given as their int ids.*'queue_length'") as caught:
            engine.add_request("req-1", TextPrompt(prompt="<image>", multi_modal_data=_media(5)))
        assert not isinstance(caught.value, OmniRequestsError)
    finally:
        installed.uninstall()

    class Failing:  # a balancer's own bug is its own error, as it is (helper-87)
        def select(self, task: object, replicas: list[int]) -> int:
            return None + 1  # type: ignore[operator]

    installed = install_stage0_scoping(engine, hasher=MediaHasher(MODEL), balancer=Failing())
    try:
        with pytest.raises(TypeError, match="unsupported operand"):
            engine.add_request("req-3", TextPrompt(prompt="<image>", multi_modal_data=_media(5)))
    finally:
        installed.uninstall()
    installed = install_stage0_scoping(
        engine, hasher=MediaHasher(MODEL), balancer=_wheel_balancer("RandomBalancer")
    )
    try:  # one that reads nothing of them chooses as before
        assert engine.add_request("req-2", TextPrompt(prompt="<image>", multi_modal_data=_media(5)))[0] in (
            0,
            1,
        )
    finally:
        installed.uninstall()


def test_a_distributed_pool_picks_with_the_attached_balancer_and_the_requests_keys() -> None:
    # docs/engine-integration.md: the balancer is attached to stage 0's pool, "whose
    # distributed pick then uses it too", with the request's media keys in the task.
    engine, pool = _Engine(), _DistributedPool([0, 1])
    engine.stage_pools = [pool]
    balancer = Stage0Balancer(CacheAffinity())
    installed = install_stage0_scoping(engine, hasher=MediaHasher(MODEL), balancer=balancer)
    record = TextPrompt(prompt="<image>", multi_modal_data=_media(5))
    try:
        assert pool._lb is balancer
        replicas = {engine.add_request(f"req-{n}", record)[0] for n in range(3)}
        assert len(replicas) == 1  # the same media, the same replica: the cache affinity
        (replica,) = replicas
        keys = [
            to_vllm(scope_to_replica(record, 0, hasher=PLAIN))["multi_modal_uuids"][m]
            for m in ("image", "video")
        ]
        bases = tuple(key.split(":", 2)[2] for modality in keys for key in modality)
        assert [task["media_keys"] for task in pool.tasks] == [bases] * 3
        assert _same(engine.input_processor.received[-1], _expected(record, replica))
    finally:
        installed.uninstall()


class _InfoPool(_DistributedPool):
    """A distributed pool whose serviceable replicas are vllm-omni ``ReplicaInfo``s (known
    by their input addresses), of its own addresses."""

    def __init__(self, *addresses: str) -> None:
        super().__init__([])
        self.clients = list(addresses)
        self.serviceable = [types.SimpleNamespace(input_addr=address) for address in addresses]  # type: ignore[misc]

    def preselect_replica_id(self, request_id: str, task: dict[str, Any] | None = None) -> int | None:
        chosen = self.serviceable[self._lb.select(task, self.serviceable)]
        return self.get_replica_id_by_addr(chosen.input_addr)  # type: ignore[attr-defined]


def test_a_balancer_serves_one_engine_at_a_time_each_with_its_own_replica_ids() -> None:
    # The installation gave the balancer the first engine's address lookup for good: on a
    # second engine's pool its replicas were unknown, or read as the first's ids (found by
    # a review, helper-63). Uninstall takes it back; two engines at once are refused.
    balancer = Stage0Balancer(RoundRobin())
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _media(8)["image"][:1]})
    engines = [_Engine() for _ in range(3)]
    for engine, addresses in zip(
        engines, (("tcp://a0", "tcp://a1"), ("tcp://b0", "tcp://b1"), ("tcp://c0",)), strict=True
    ):
        engine.stage_pools = [_InfoPool(*addresses)]
    install_stage0_scoping(engines[0], hasher=PLAIN, balancer=balancer).uninstall()
    assert balancer.replica_id is None
    second = install_stage0_scoping(engines[1], hasher=PLAIN, balancer=balancer)
    try:
        replica, sent = engines[1].add_request("req-1", record)
        assert replica in (0, 1) and _same(sent, _expected(record, replica))  # type: ignore[arg-type]
        before = dict(vars(engines[2]))
        with pytest.raises(PromptTypeError, match="another engine's stage-0 pool") as caught:
            install_stage0_scoping(engines[2], hasher=PLAIN, balancer=balancer)
        assert caught.value.path == "balancer" and vars(engines[2]) == before
    finally:
        second.uninstall()


def test_uninstall_gives_the_engine_back_its_own_code_and_its_pools_balancer() -> None:
    # docs/engine-integration.md: scoping.uninstall() runs "the engine's own code again".
    # It attached None to the pool, where vllm-omni's membership controller had attached
    # its own balancer in distributed mode: the distributed pick was left without one.
    engine, pool = _Engine(), _DistributedPool([0, 1])
    engine.stage_pools = [pool]
    own = Stage0Balancer(RoundRobin())
    pool.attach_load_balancer(own)
    engine_attributes, process_inputs = dict(vars(engine)), engine.input_processor.process_inputs
    installed = install_stage0_scoping(
        engine, hasher=MediaHasher(MODEL), balancer=Stage0Balancer(CacheAffinity())
    )
    assert pool._lb is not own and engine._build_add_request_message.__self__ is installed  # type: ignore[attr-defined]
    installed.uninstall()
    assert pool._lb is own
    assert vars(engine) == engine_attributes and "process_inputs" not in vars(engine.input_processor)
    assert engine.input_processor.process_inputs == process_inputs
    assert engine._build_add_request_message.__func__ is _Engine._build_add_request_message  # type: ignore[attr-defined]


def _installed_on(engine: _Engine) -> Any:
    return engine.__dict__.get("_scope_stage0_multimodal_cache_to_replica").__self__  # type: ignore[union-attr]


def test_uninstall_called_again_leaves_an_installation_made_since_in_place() -> None:
    # A second uninstall() put back what the first installation had found, the engine's
    # own helper and builder, over a second installation: its requests went the engine's
    # own way (keys written into the caller's dict) and the pool got the first's balancer.
    engine, pool = _Engine(), _Pool()
    engine.stage_pools = [pool]
    first = install_stage0_scoping(engine, hasher=MediaHasher(MODEL), balancer=Stage0Balancer(RoundRobin()))
    first.uninstall()
    second = install_stage0_scoping(
        engine, hasher=MediaHasher(MODEL), balancer=Stage0Balancer(CacheAffinity())
    )
    try:
        first.uninstall()
        assert _installed_on(engine) is second
        assert engine._build_add_request_message.__self__ is second  # type: ignore[attr-defined]
        assert engine.input_processor.process_inputs == second.process_inputs
        assert pool._lb is second.balancer
        record = TextPrompt(prompt="<image>", multi_modal_data={"image": _media(4)["image"][:1]})
        replica, sent = engine.add_request("after", record)
        assert _same(sent, _expected(record, replica))  # type: ignore[arg-type]
    finally:
        second.uninstall()
    assert "_scope_stage0_multimodal_cache_to_replica" not in vars(engine) and pool._lb is None
    assert "process_inputs" not in vars(engine.input_processor)


def test_installing_a_handle_already_installed_is_refused_and_changes_nothing() -> None:
    # install() again kept the installation's own code as what to give back: uninstall
    # then left it in the engine for good.
    engine = _Engine()
    installed = install_stage0_scoping(engine, hasher=MediaHasher(MODEL))
    before, processor_before = dict(vars(engine)), dict(vars(engine.input_processor))
    with pytest.raises(PromptTypeError, match="already has our scoping installed") as caught:
        installed.install()
    assert caught.value.path == "engine"
    assert vars(engine) == before and vars(engine.input_processor) == processor_before
    installed.uninstall()
    assert "_scope_stage0_multimodal_cache_to_replica" not in vars(engine)
    assert "process_inputs" not in vars(engine.input_processor)
    installed.install().uninstall()  # uninstalled, the same handle installs again
    assert "_build_add_request_message" not in vars(engine)


def test_an_engine_without_an_input_processor_is_refused_by_name() -> None:
    # vllm-omni has none where stage 0 is a diffusion stage: installing raised
    # AttributeError on None (found by a review, helper-85).
    engine = _Engine()
    engine.input_processor = None
    before = dict(vars(engine))
    with pytest.raises(PromptTypeError, match="has no input processor") as caught:
        install_stage0_scoping(engine, hasher=MediaHasher(MODEL))
    assert caught.value.path == "engine" and vars(engine) == before


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_two_engines_sharing_one_input_processor_give_it_back_as_it_was(order: str) -> None:
    # Uninstalled first, A found B's wrapper on top and left its own under it; B's
    # uninstall then put A's back, for good. Meanwhile each engine's requests are scoped.
    engines = {"A": _Engine(), "B": _Engine()}
    engines["B"].input_processor = processor = engines["A"].input_processor
    installed = {
        name: install_stage0_scoping(engine, hasher=MediaHasher(MODEL), balancer=Stage0Balancer(RoundRobin()))
        for name, engine in engines.items()
    }
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": _media(5)["image"][:1]})
    for name in order:
        installed[name].uninstall()
        for other in set(engines) - set(order[: order.index(name) + 1]):
            replica, sent = engines[other].add_request(f"after-{name}", record)
            assert _same(sent, _expected(record, replica))  # type: ignore[arg-type]
    assert "process_inputs" not in vars(processor)


class _EqualsAnything(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


class _Replica(enum.IntEnum):
    FIRST = 0
    SECOND = 2


@pytest.mark.parametrize(
    "choice", [True, np.True_, 1.0, np.int64(1), np.float64(1.0), 3, None, "1", _EqualsAnything(7)]
)
def test_the_balancer_refuses_a_choice_that_is_no_live_replica_id(choice: Any) -> None:
    # As scope_stage0 refuses it (both roads ask is_replica_id): a bool or a number equal
    # to an id is no replica id, so a policy behaves the same under either.
    balancer = Stage0Balancer(lambda request: choice)
    with pytest.raises(ValueError, match=r"chose .*which is not among the replicas \[0, 2, 1\]"):
        balancer.select({"request_id": "r"}, [0, 2, 1])
    if choice is not None:  # None from a pool's select means "leave it unscoped"
        given = {"prompt": "x", "multi_modal_data": {"image": np.zeros((2, 2, 3), np.uint8)}}
        pool = Stage0Pool(replicas=[0, 2, 1], select=lambda request: choice)
        with pytest.raises(InvalidPromptError, match="not a live replica id"):
            scope_stage0(given, pool=pool, hasher=MediaHasher(MODEL))


def test_an_int_enum_choice_is_read_as_the_id_it_holds_on_both_roads() -> None:
    assert Stage0Balancer(lambda request: _Replica.SECOND).select({"request_id": "r"}, [0, 2, 1]) == 1
    given = {"prompt": "x", "multi_modal_data": {"image": np.zeros((2, 2, 3), np.uint8)}}
    pool = Stage0Pool(replicas=[0, 2, 1], select=lambda request: _Replica.SECOND)
    replica, sent = scope_stage0(given, pool=pool, hasher=MediaHasher(MODEL))
    assert type(replica) is int and replica == 2
    assert sent["multi_modal_uuids"]["image"][0].startswith("stage0:rep2:")


def test_a_replica_id_that_is_no_int_is_refused_by_name_as_the_pool_refuses_it() -> None:
    # Before, numpy ids from replica_id reached the policy, whose choice among them was
    # then refused as "not among the replicas" on every request.
    ids = {"a": np.int64(0), "b": np.int64(1)}
    for policy in (RoundRobin(), CacheAffinity()):
        balancer = Stage0Balancer(policy, replica_id=lambda replica: ids[replica])
        with pytest.raises(PromptTypeError, match=r"must be an int, got numpy.int64") as caught:
            balancer.select({"request_id": "r", "media_keys": ["k"]}, ["a", "b"])
        assert caught.value.path == "$.replicas"
    assert Stage0Balancer(lambda request: 1).select({"request_id": "r"}, [0, 2, 1]) == 2


@pytest.mark.parametrize(
    "pool", [_DistributedPool([]), "no preselect"], ids=["none serviceable", "no preselect"]
)
def test_a_distributed_pool_that_cannot_preselect_leaves_the_prompt_unscoped(pool: Any) -> None:
    engine = _Engine()
    if pool == "no preselect":
        pool = _Pool()
        pool.is_distributed = True
    engine.stage_pools = [pool]
    installed = install_stage0_scoping(engine, hasher=MediaHasher(MODEL))
    given = {"prompt": "<image>", "multi_modal_data": {"image": np.zeros((4, 4, 3), np.uint8)}}
    try:
        replica, sent = engine.add_request("req", given)
    finally:
        installed.uninstall()
    assert replica is None and "multi_modal_uuids" not in sent  # as vllm-omni: nothing scoped


def _palette_image() -> Image.Image:
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 255, 255, 255] * 128)
    return image


def test_a_request_block_is_entered_once_and_leaves_nothing_behind() -> None:
    # one_request and unsealed are entered on every routed request. Entered a second
    # time (nested, or by another thread) a block would share its request's digests and
    # lose its first entry's state; it is refused, before anything changes.
    from omni_requests import rendered_uuids
    from omni_requests._adapter_api import one_request, unsealed

    image = _palette_image()  # kept unsealed by records: keyed at every render
    scoped = scope_to_replica(
        TextPrompt(prompt="<image>", multi_modal_data={"image": image}), 0, hasher=PLAIN
    )
    block = one_request(PLAIN)
    with block:
        first = rendered_uuids(scoped)
        with pytest.raises(RuntimeError, match="entered once"), block:
            pass
        image.putpixel((0, 0), 0)
        assert rendered_uuids(scoped) == first  # the request's digest, reused within it
    assert rendered_uuids(scoped) != first  # and not after it
    with pytest.raises(RuntimeError, match="entered once"), block:
        pass

    photo = Image.new("RGB", (4, 4), (1, 2, 3))
    kept = unsealed()
    with kept:
        assert (
            TextPrompt(prompt="<image>", multi_modal_data={"image": photo}).multi_modal_data["image"][0]
            is photo
        )
        with pytest.raises(RuntimeError, match="entered once"), kept:
            pass
    assert (
        TextPrompt(prompt="<image>", multi_modal_data={"image": photo}).multi_modal_data["image"][0]
        is not photo
    )
