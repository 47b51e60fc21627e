"""Our stage-0 scoping, installed into a running vllm-omni ``AsyncOmniEngine``.

vllm-omni 0.30 scopes stage-0 media keys in ``_scope_stage0_multimodal_cache_to_replica``,
which writes them into the caller's prompt and returns only the replica id; the prompt
it wrote into then goes to ``input_processor.process_inputs``. The fix upstream is two
lines at that call site: take a new prompt back and pass it on,

    replica, prompt = scope_stage0(prompt, pool=..., hasher=..., request_id=request_id)

:func:`install_stage0_scoping` does exactly that in an engine that is already running,
without editing vllm-omni: it replaces that helper on the engine (the instance, not the
class) by :func:`scope_stage0`, at the same point of the request path (after vllm-omni's
own prompt transform), and hands the scoped prompt to ``process_inputs`` for the same
request id. Records are accepted too (below).

It also gives the engine a copy of the caller's prompt to work on: vllm-omni writes a
``global_request_id`` into the prompt's ``additional_information`` before scoping, which
would otherwise reach the caller's dict as well. A record enters as its engine dict
(``to_vllm``): vllm-omni reads the prompt as a dict all along the way (that id, a
model's prompt transform, the omni-only fields it restores after ``process_inputs``,
CFG companions, what later stages get), and a record there lost them. Its images and
tensors are hand-outs of its seals, which scoping reads back without a copy or a hash.

CFG companions (``_build_cfg_companions``: the same request again, without text or
image, for classifier-free guidance) go to their parent's replica: their media keys
are scoped to it too. vllm-omni sends them unscoped, under keys the replica-scoped
parents never use.

This module imports neither vllm-omni nor vLLM; it knows the engine's attributes.
"""

from __future__ import annotations

import contextvars
import copy
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol

from omni_requests import (
    EmbedsPrompt,
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
    scope_to_replica,
)
from omni_requests._adapter_api import check_index, type_name, unscoped, unsealed, values_equal
from omni_requests_vllm import from_vllm, to_vllm

from ._routing import RouteRequest, SelectReplica, live_replica_id
from ._stage0 import Stage0Pool, carries_media, scope_stage0

__all__ = ["LoadBalancer", "Stage0Balancer", "Stage0Scoping", "install_stage0_scoping"]

_HELPER = "_scope_stage0_multimodal_cache_to_replica"
_BUILD = "_build_add_request_message"
_COMPANIONS = "_build_cfg_companions"
# Scoped prompts of calls made outside the message builder, kept until their
# process_inputs; the bound only stops an engine that never makes that call from growing it.
_SCOPED_KEPT: Final = 4096
# Parents kept for their CFG companions, which vllm-omni builds right after the parent's
# message, in the same thread; the bound only stops a builder that never follows.
_PARENTS_KEPT: Final = 64
_RECORDS = (TextPrompt, TokensPrompt, EmbedsPrompt, EncoderDecoderPrompt)
_MISSING = object()


class _PoolReplicaIds:
    """A distributed pool's replica id of a vllm-omni ``ReplicaInfo``, by its input address:
    what an installation gives a :class:`Stage0Balancer` that has no ``replica_id``."""

    __slots__ = ("pool",)

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def __call__(self, replica: Any) -> int | None:
        return self.pool.get_replica_id_by_addr(replica.input_addr)  # type: ignore[no-any-return]


class _Made(NamedTuple):
    """A scoped record's engine dict, as the message builder made it."""

    data: object  # the dict's multi_modal_data: a shallow copy of the dict shares it
    uuids: object  # a copy of its multi_modal_uuids: a deep copy of the dict has equal ones
    record: Any


class _Copies:
    """What the message builder made of one request's prompt, known by its objects: the
    engine dicts of its scoped records, and the dicts scoped as they are (its copies of
    the caller's own dicts, unscoped records' dicts)."""

    __slots__ = ("made", "plain")

    def __init__(self) -> None:
        self.made: list[_Made] = []
        # each such dict's multi_modal_data, and a copy of its multi_modal_uuids
        self.plain: list[tuple[object, object]] = []

    def is_plain(self, prompt: Mapping[str, Any]) -> bool:
        """Whether ``prompt`` is one of the dicts scoped as they are (or a shallow copy)."""
        data = prompt.get("multi_modal_data")
        return data is not None and any(data is own for own, _ in self.plain)

    def copies_plain(self, prompt: Mapping[str, Any]) -> bool:
        """Whether ``prompt`` is a deep copy of one of the dicts scoped as they are."""
        uuids, data = prompt.get("multi_modal_uuids"), prompt.get("multi_modal_data")
        return any(_equal(uuids, own_uuids) and values_equal(data, own) for own, own_uuids in self.plain)


def _equal(a: object, b: object) -> bool:
    """``a == b`` as a plain True: an array's elementwise answer, or an ``__eq__`` that
    raises, is no match (the dict is then read as it is, and refused by name if bad)."""
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001 - a caller's object's own __eq__
        return False


class _Parent(NamedTuple):
    """A request's parent, for its CFG companions: its stage-0 replica, the policy its
    keys were scoped under and what its prompt was made of."""

    owner: Stage0Scoping
    request_id: str
    replica: int
    policy: KeyPolicy | None
    copies: _Copies


# While a request's CFG companions are built: its parent.
_BUILDING_COMPANIONS: Final[contextvars.ContextVar[_Parent | None]] = contextvars.ContextVar(
    "omni_requests building companions", default=None
)


class _Call:
    """One call of the engine's message builder: what its scoping hands its
    ``process_inputs``. Carried per call (a context variable), never by request id: two
    requests sharing an id in flight would take each other's scoped prompt."""

    __slots__ = ("copies", "owner", "parent", "request_id", "scoped")

    def __init__(self, owner: Stage0Scoping, request_id: object, copies: _Copies) -> None:
        self.owner = owner
        self.request_id = request_id
        self.copies = copies
        self.scoped: Any = _MISSING
        self.parent: _Parent | None = None  # set where the request is scoped to a replica


_CALL: Final[contextvars.ContextVar[_Call | None]] = contextvars.ContextVar(
    "omni_requests stage-0 call", default=None
)


class LoadBalancer(Protocol):
    """vllm-omni's load-balancer protocol (``vllm_omni.distributed.omni_coordinator``).

    ``select`` returns an *index into* ``replicas``. vllm-omni's own
    ``RoundRobinBalancer`` and ``RandomBalancer`` fit it, and so does
    :class:`Stage0Balancer`.
    """

    def select(self, task: Any, replicas: list[Any]) -> int: ...


class Stage0Balancer:
    """One of our policies (``RoundRobin()``, ``CacheAffinity()``) as a vllm-omni load balancer.

    ``select(task, replicas)`` asks ``policy`` with a :class:`RouteRequest` made of the
    task's ``request_id``, the replica ids and the task's ``media_keys`` (the unscoped key
    bases, which the installed scoping puts in the task), and returns the index of the
    chosen replica. A replica is an ``int`` id (a local pool) or vllm-omni's
    ``ReplicaInfo`` (a distributed pool), whose id ``replica_id`` gives; the installation
    sets it to the pool's ``get_replica_id_by_addr`` of the replica's ``input_addr``.
    """

    def __init__(
        self, policy: SelectReplica, *, replica_id: Callable[[Any], int | None] | None = None
    ) -> None:
        if not callable(policy):
            raise PromptTypeError("policy", f"must be callable, got {type_name(policy)}")
        self.policy = policy
        self.replica_id = replica_id

    def _id(self, replica: Any) -> int:
        if isinstance(replica, int) and not isinstance(replica, bool):
            return check_index("$.replicas", replica)
        found = None if self.replica_id is None else self.replica_id(replica)
        if found is None:
            raise PromptTypeError(
                "$.replicas", f"a replica must be an int id or known to replica_id, got {type_name(replica)}"
            )
        # A plain int, as Stage0Pool takes ids: a numpy id from replica_id is refused here,
        # by name, not later as a policy's choice "not among the replicas".
        return check_index("$.replicas", found)

    def select(self, task: Mapping[str, Any], replicas: Sequence[Any]) -> int:
        if not replicas:
            raise ValueError("replicas must not be empty")  # as vllm-omni's balancers say it
        ids = [self._id(replica) for replica in replicas]
        keys = task.get("media_keys", ())
        chosen = self.policy(RouteRequest(task.get("request_id"), ids, keys))
        found = live_replica_id(chosen, ids)  # as scope_stage0 reads it
        if found is None:
            raise ValueError(f"{self.policy!r} chose {chosen!r}, which is not among the replicas {ids}")
        return ids.index(found)

    def __repr__(self) -> str:
        return f"Stage0Balancer({self.policy!r})"


def _engine_copy(prompt: Any, copies: _Copies) -> Any:
    """The caller's dicts and lists copied at every level (media items shared, not copied),
    single records as their engine dicts, all noted in ``copies``. A scoped record's dict
    carries its UUIDs as the caller gave them, never the keys of its old scope: vllm-omni
    keeps this dict (``original_prompt``) for its CFG companions and later stages. An
    encoder-decoder record stays a record, and an encoder-decoder dict with media becomes
    one: vllm-omni adds fields at its top level that an encoder-decoder dict has no place
    for, and scoping then refused it."""
    if isinstance(prompt, EncoderDecoderPrompt):
        return prompt
    if isinstance(prompt, Mapping) and "encoder_prompt" in prompt and carries_media(prompt):
        return from_vllm(prompt)
    if isinstance(prompt, (TextPrompt, TokensPrompt, EmbedsPrompt)):
        engine = to_vllm(unscoped(prompt))
        data = engine.get("multi_modal_data")
        if data is not None:
            if prompt.scope is None:
                copies.plain.append((data, copy.deepcopy(engine.get("multi_modal_uuids"))))
            else:
                copies.made.append(_Made(data, copy.deepcopy(engine.get("multi_modal_uuids")), prompt))
        return engine
    if isinstance(prompt, dict):
        copied = {key: _engine_copy(value, copies) for key, value in prompt.items()}
        data = copied.get("multi_modal_data")
        if data is not None:
            copies.plain.append((data, copy.deepcopy(copied.get("multi_modal_uuids"))))
        return copied
    if isinstance(prompt, list):
        return [_engine_copy(value, copies) for value in prompt]
    return prompt


def _as_scoped_records(prompt: Any, copies: _Copies, hasher: MediaHasher) -> Any:
    """``prompt`` with each scoped record's engine dict read back as that record, under its
    policy (a dict alone would be scoped without it).

    A dict is a record's if it shares the record's engine dict's ``multi_modal_data``
    (that dict, or a shallow copy a prompt transform made), or if it is a deep copy of it:
    equal UUIDs and media equal to the record's. Never the caller's own dict, whatever its
    UUIDs: a copy of a scoped record's dict given new media would go out under the old
    media's keys (scoping refuses such a dict by name). The dict's other fields are taken
    as vllm-omni left them (its ``global_request_id``, a prompt transform's changes); its
    items, untouched hand-outs, come back without a copy or a hash."""
    if isinstance(prompt, list):
        return [_as_scoped_records(item, copies, hasher) for item in prompt]
    if not isinstance(prompt, Mapping):
        return prompt
    data = prompt.get("multi_modal_data")
    for made in copies.made:
        if data is made.data:
            return _read_back(prompt, made.record, hasher, same_media=False)
    if copies.is_plain(prompt):
        return prompt
    # A deep copy: of every prompt it equals, records and dicts alike, one policy must be
    # kept, or none can be told apart (two tenants' records of equal media and UUIDs).
    uuids = prompt.get("multi_modal_uuids")
    found: list[tuple[KeyPolicy, Any]] = []
    for made in copies.made:
        if _equal(uuids, made.uuids):
            record = _read_back(prompt, made.record, hasher, same_media=True)
            if record is not None:
                found.append((made.record.scope.policy, record))
    if found and copies.copies_plain(prompt):
        found.append((_DEFAULT_POLICY, prompt))
    if len({policy for policy, _ in found}) > 1:
        raise InvalidPromptError(
            "$.multi_modal_uuids",
            "a prompt transform copied the dicts of prompts scoped under different key policies "
            "whose media and UUIDs are equal, so which is which cannot be told; keep each dict's "
            "multi_modal_data (a shallow copy does)",
        )
    if found:
        return found[0][1]
    if carries_media(prompt):
        return _under_the_requests_policy(prompt, copies, hasher)
    return prompt


def _read_back(prompt: Mapping[str, Any], record: Any, hasher: MediaHasher, *, same_media: bool) -> Any:
    """``prompt``, a scoped record's engine dict, as that record (None where
    ``same_media`` and its media are not the record's)."""
    plain = {name: value for name, value in prompt.items() if name != "multi_modal_uuids"}
    bases = {modality: list(found) for modality, found in record.multi_modal_uuids.items()}
    if bases:
        plain["multi_modal_uuids"] = bases
    with unsealed():
        rebuilt = from_vllm(plain)
    if same_media and not (
        isinstance(rebuilt, (TextPrompt, TokensPrompt, EmbedsPrompt))
        and values_equal(rebuilt.multi_modal_data, record.multi_modal_data)
    ):
        return None
    scope = record.scope
    return scope_to_replica(rebuilt, scope.replica_id, hasher=hasher, policy=scope.policy)


def _under_the_requests_policy(prompt: Mapping[str, Any], copies: _Copies, hasher: MediaHasher) -> Any:
    """A dict with media that matches no scoped record of its request (a prompt transform
    rebuilt it without the record's UUIDs), under the policy the request's records were
    scoped with: scoped as a plain dict, it lost a tenant's keys."""
    made = copies.made
    policies = {record.scope.policy for *_, record in made} - {_DEFAULT_POLICY}
    if not policies:
        return prompt
    if len(policies) > 1:
        raise InvalidPromptError(
            "$.multi_modal_uuids",
            "a prompt transform returned a dict without the keys of the records it was made from, "
            "which were scoped under different key policies, so none can be kept; keep "
            "multi_modal_uuids in the dict it returns",
        )
    with unsealed():
        rebuilt = from_vllm(prompt)
    return scope_to_replica(rebuilt, made[0].record.scope.replica_id, hasher=hasher, policy=policies.pop())


_DEFAULT_POLICY: Final = KeyPolicy()


def _builds_companions(engine: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether vllm-omni builds CFG companions after this message (its add_request does
    for an engine with a prompt expansion and a request past stage 0; a streaming update,
    add_streaming_update's, never)."""
    if getattr(engine, "prompt_expand_func", None) is None:
        return False
    if kwargs.get("message_type", "add_request") != "add_request":  # a streaming update: none
        return False
    final_stage_id = kwargs.get("final_stage_id", args[4] if len(args) > 4 else 0)
    return not isinstance(final_stage_id, int) or final_stage_id > 0


def _policy_of(prompt: Any) -> KeyPolicy | None:
    """The policy of the first scoped record in ``prompt`` (its companions inherit it)."""
    for item in prompt if isinstance(prompt, list) else [prompt]:
        scope = getattr(item, "scope", None) if isinstance(item, _RECORDS) else None
        if scope is not None:
            return scope.policy  # type: ignore[no-any-return]
    return None


def _to_engine(prompt: Any) -> Any:
    """Records become vllm-omni dicts; everything else goes to ``process_inputs`` as it is."""
    if isinstance(prompt, _RECORDS):
        return to_vllm(prompt)
    if isinstance(prompt, list) and any(isinstance(item, _RECORDS) for item in prompt):
        return [_to_engine(item) for item in prompt]
    return prompt


# Where vllm-omni 0.30 lists the folders a model's prompt transform made for a request
# (REQUEST_ARTIFACT_DIRS_KEY in vllm_omni/data_entry_keys.py; a test reads the wheel's).
ARTIFACT_DIRS_KEY: Final = "_omni_request_artifact_dirs"


def _remove_artifacts(engine_prompt: object) -> None:
    """What the engine's ``add_request`` does with the caller's prompt when its message
    cannot be built: remove the folders a model's prompt transform made for the request.
    vllm-omni lists them in the prompt its builder was given, our copy, which
    ``add_request`` never sees: each refused request left its folders on disk (found by
    a review, helper-85)."""
    folders = engine_prompt.pop(ARTIFACT_DIRS_KEY, None) if type(engine_prompt) is dict else None
    for folder in folders if isinstance(folders, list) else ():
        if isinstance(folder, str):
            shutil.rmtree(folder, ignore_errors=True)


class Stage0Scoping:
    """What :func:`install_stage0_scoping` put into an engine; :meth:`uninstall` takes it out."""

    def __init__(self, engine: Any, hasher: MediaHasher, balancer: LoadBalancer | None) -> None:
        self.engine = engine
        self.hasher = hasher
        self.balancer = balancer
        # request id -> scoped prompt, between the two calls, where the engine calls them
        # outside its message builder (inside it they pass per call: _Call)
        self._scoped: dict[str, Any] = {}
        # id of a request's prompt as the message builder made it -> the request, for its
        # CFG companions (built from that object; two requests may share an id)
        self._parents: dict[int, _Parent] = {}
        self._lock = threading.Lock()
        # Calls of the message builder under way, and whether uninstall() waits for them
        # to give the processor its process_inputs back (a call between its scoping and
        # its process_inputs would reach the engine's own without its scoped prompt).
        self._in_flight = 0
        self._uninstalling = False
        self._installed = False
        self._pool_balancer: Any = None
        self._processor = engine.input_processor
        leaving = _leaving(self._processor.__dict__.get("process_inputs"))
        # Under an installation whose uninstall waits for its requests in flight: the
        # engine's own process_inputs, which this one gives back in its turn.
        self._process_inputs: Callable[..., Any] = (
            self._processor.process_inputs if leaving is None else leaving._process_inputs
        )
        self._build = getattr(engine, _BUILD)
        self._build_companions = getattr(engine, _COMPANIONS, None)
        self._before: tuple[object, object, object, object] = (_MISSING, _MISSING, _MISSING, _MISSING)

    # -- the three places of the request path --

    def build_add_request_message(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's own message builder, given a copy of the caller's prompt (a record's
        engine dict)."""
        copies = _Copies()
        if "prompt" in kwargs:
            kwargs["prompt"] = engine_prompt = _engine_copy(kwargs["prompt"], copies)
        elif len(args) > 1:
            engine_prompt = _engine_copy(args[1], copies)
            args = (args[0], engine_prompt, *args[2:])
        else:
            engine_prompt = _MISSING
        request_id = kwargs.get("request_id", args[0] if args else None)
        call = _Call(self, request_id, copies)
        token = _CALL.set(call)
        with self._lock:
            self._in_flight += 1
            # An object's id is taken again once it is gone: never an old parent's.
            self._parents.pop(id(engine_prompt), None)
        try:
            try:
                message = self._build(*args, **kwargs)
            except BaseException:
                _remove_artifacts(engine_prompt)
                raise
            if call.parent is not None and self._installed and _builds_companions(self.engine, args, kwargs):
                # vllm-omni builds the companions next, from the message's original_prompt:
                # this very object, which tells two requests sharing an id apart.
                with self._lock:
                    self._parents[id(engine_prompt)] = call.parent
                    if len(self._parents) > _PARENTS_KEPT:
                        del self._parents[next(iter(self._parents))]
            return message
        finally:
            _CALL.reset(token)
            with self._lock:
                self._in_flight -= 1
                last = self._uninstalling and self._in_flight == 0
                if last:
                    self._uninstalling = False
            if last:
                self._give_back_process_inputs()

    def _this_call(self, request_id: object) -> _Call | None:
        call = _CALL.get()
        return call if call is not None and call.owner is self and call.request_id == request_id else None

    def scope(self, request_id: str, prompt: Any) -> int | None:
        """In place of the engine's helper: choose and bind a replica, scope purely, keep the result."""
        pools = getattr(self.engine, "stage_pools", None)
        if not pools:
            return None
        pool = pools[0]
        stage0 = Stage0Pool(
            replicas=pool.live_replica_ids(),
            is_diffusion=pool.stage_type == "diffusion",
            select=lambda route: self._select(pool, route),
        )
        call = self._this_call(request_id)
        if call is not None:
            prompt = _as_scoped_records(prompt, call.copies, self.hasher)
        # as_dicts: the dicts are rendered with the keys routing computed, in this one call.
        replica, scoped = scope_stage0(
            prompt, pool=stage0, hasher=self.hasher, request_id=request_id, as_dicts=True
        )
        with self._lock:
            if call is not None:
                call.scoped = scoped
                if replica is not None and isinstance(request_id, str):
                    call.parent = _Parent(self, request_id, replica, _policy_of(prompt), call.copies)
            else:
                self._scoped[request_id] = scoped
                if len(self._scoped) > _SCOPED_KEPT:  # a request that never reached process_inputs
                    del self._scoped[next(iter(self._scoped))]
        return replica

    def build_cfg_companions(self, parent_id: str, *args: Any, **kwargs: Any) -> Any:
        """The engine's own companion builder, with the parent's replica known to ``process_inputs``."""
        original = kwargs.get("original_prompt", args[0] if args else _MISSING)
        with self._lock:
            parent = self._parents.pop(id(original), None)
        if parent is not None and parent.request_id != parent_id:
            parent = None
        token = _BUILDING_COMPANIONS.set(parent)
        try:
            return self._build_companions(parent_id, *args, **kwargs)  # type: ignore[misc]
        finally:
            _BUILDING_COMPANIONS.reset(token)

    def process_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's ``process_inputs``, given the scoped prompt of the same request (a
        CFG companion's scoped to its parent's replica)."""
        request_id = kwargs.get("request_id")
        # The call's own installation, or one uninstalled since whose request is in flight.
        call = _CALL.get()
        if call is not None and call.request_id == request_id and call.scoped is not _MISSING:
            scoped, call.scoped = call.scoped, _MISSING
        else:
            with self._lock:
                scoped = self._scoped.pop(request_id, _MISSING)  # type: ignore[arg-type]
        if scoped is not _MISSING:
            kwargs["prompt"] = scoped
        elif "prompt" in kwargs:
            parent = _BUILDING_COMPANIONS.get()
            # Scoped by the parent's own installation only: another engine's sharing this
            # processor, whose wrapper this call also goes through, would scope it twice.
            if (
                parent is not None
                and parent.owner is self
                and isinstance(request_id, str)
                and request_id.startswith(parent.request_id)
            ):
                kwargs["prompt"] = self._companion(kwargs["prompt"], parent)
        if "prompt" in kwargs:
            kwargs["prompt"] = _to_engine(kwargs["prompt"])
        return self._process_inputs(*args, **kwargs)

    def _companion(self, prompt: Any, parent: _Parent) -> Any:
        """A companion's prompt scoped to its parent's replica, under its parent's policy
        (prompts without media as they are). A copy of a scoped record's engine dict (a
        model's expansion copies its parent's) is read back as that record."""
        if isinstance(prompt, list):
            return [self._companion(item, parent) for item in prompt]
        if isinstance(prompt, Mapping):
            if not prompt.get("multi_modal_data"):
                return prompt
            with unsealed():  # its items are the parent's (hand-outs read back without a copy)
                prompt = _as_scoped_records(prompt, parent.copies, self.hasher)
                if isinstance(prompt, Mapping):
                    prompt = from_vllm(prompt)
        if isinstance(prompt, _RECORDS):
            scoped = scope_to_replica(prompt, parent.replica, hasher=self.hasher, policy=parent.policy)
            return to_vllm(scoped)
        return prompt

    # -- choosing a replica --

    def _select(self, pool: Any, route: RouteRequest) -> int | None:
        request_id = route.request_id
        if bool(getattr(pool, "is_distributed", False)):
            preselect = getattr(pool, "preselect_replica_id", None)
            if not callable(preselect):
                return None  # as vllm-omni: nothing is scoped
            task = {"request_id": request_id}
            if self.balancer is not None:
                task["media_keys"] = route.media_keys  # type: ignore[assignment]
            return preselect(request_id, task)  # type: ignore[no-any-return]
        if self.balancer is None:
            return pool.select_replica_id(request_id)  # type: ignore[no-any-return]
        available = set(pool.available_replica_ids())
        replicas = [replica for replica in route.replicas if replica in available]
        if not replicas:
            return None
        bound = getattr(pool, "get_bound_replica_id", None)
        held = bound(request_id) if callable(bound) and request_id is not None else None
        if held in replicas:
            # A request already bound (a streaming update of it) stays on the replica that
            # holds it, as the pool's own select_replica_id keeps it: asked again, the
            # balancer could send the update to a replica that has no such request.
            return held  # type: ignore[no-any-return]
        try:
            index = self.balancer.select({"request_id": request_id, "media_keys": route.media_keys}, replicas)
        except AttributeError as error:
            if not isinstance(error.obj, int):  # the balancer's own failing: as it is
                raise
            # It read a replica id as a ReplicaInfo: the server's set-up, not the request.
            raise TypeError(
                "balancer: cannot choose among a local pool's replicas, which it is given as their "
                f"int ids (vllm-omni's distributed pools give ReplicaInfos); it read {error.name!r} of one"
            ) from error
        replica = replicas[index]
        _bind(pool, request_id, replica)
        return replica

    # -- in and out --

    def install(self) -> Stage0Scoping:
        """Put the scoping into the engine (``install_stage0_scoping`` calls this).

        Refused while the engine has an installation of ours, this one included: what it
        keeps to give back would be that installation's code, not the engine's.
        """
        if isinstance(getattr(self.engine.__dict__.get(_HELPER), "__self__", None), Stage0Scoping):
            raise PromptTypeError("engine", "already has our scoping installed; uninstall it first")
        pool = self.engine.stage_pools[0]
        balancer = self.balancer if isinstance(self.balancer, Stage0Balancer) else None
        ids = None if balancer is None else balancer.replica_id
        if isinstance(ids, _PoolReplicaIds) and ids.pool is not pool:
            raise PromptTypeError(
                "balancer",
                "is installed on another engine's stage-0 pool, whose replica ids it reads; "
                "give each engine a Stage0Balancer of its own",
            )
        process_inputs = self._processor.__dict__.get("process_inputs", _MISSING)
        leaving = _leaving(process_inputs)
        self._before = (
            self.engine.__dict__.get(_BUILD, _MISSING),
            self.engine.__dict__.get(_HELPER, _MISSING),
            # Under an installation whose uninstall waits, its wrapper all the same: given
            # back before its requests are through, they would reach the engine's own without
            # their scoped prompts (_live skips it once they are). This handle's own, installed
            # again while it waited: what it had.
            self._before[2] if leaving is self else process_inputs,
            self.engine.__dict__.get(_COMPANIONS, _MISSING),
        )
        with self._lock:
            self._uninstalling = False  # this handle again, while its uninstall waited: it stays
        setattr(self.engine, _BUILD, self.build_add_request_message)
        setattr(self.engine, _HELPER, self.scope)
        self._processor.process_inputs = self.process_inputs
        if self._build_companions is not None:
            setattr(self.engine, _COMPANIONS, self.build_cfg_companions)
        if self.balancer is not None:
            # The balancer the pool had (vllm-omni's membership controller attaches its own
            # in distributed mode; StagePool keeps it as _lb, with no getter): uninstall
            # gives it back, where None would leave the distributed pick without one.
            self._pool_balancer = getattr(pool, "_lb", None)
            if balancer is not None and ids is None:  # uninstall takes it back
                balancer.replica_id = _PoolReplicaIds(pool)
            pool.attach_load_balancer(self.balancer)  # a distributed pool's own pick uses it too
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Give the engine back the helper, message builder and ``process_inputs`` it had.

        New requests take the engine's own path at once; ``process_inputs`` goes back when
        the requests already in the message builder are through it, each with its scoped
        prompt (an installation made meanwhile takes it over, and gives it back in turn).
        Called again, it does nothing: it would put back what this installation found,
        over an installation made since.
        """
        with self._lock:
            installed, self._installed = self._installed, False
        if not installed:
            return
        with self._lock:
            self._parents.clear()  # companions built from now on go the engine's own way
        build, helper, _, companions = self._before
        _put_back(self.engine, _BUILD, build)
        _put_back(self.engine, _HELPER, helper)
        if self._build_companions is not None:
            _put_back(self.engine, _COMPANIONS, companions)
        with self._lock:
            self._uninstalling = self._in_flight > 0
            now = not self._uninstalling
        if now:
            self._give_back_process_inputs()
        if self.balancer is not None:
            pool = self.engine.stage_pools[0]
            pool.attach_load_balancer(self._pool_balancer)
            ids = getattr(self.balancer, "replica_id", None)
            if isinstance(ids, _PoolReplicaIds) and ids.pool is pool:
                self.balancer.replica_id = None  # type: ignore[attr-defined]  # the next engine's to set

    def _give_back_process_inputs(self) -> None:
        # Unless an installation made since has put its own there (it wraps the engine's
        # own and gives that back).
        if self._processor.__dict__.get("process_inputs") == self.process_inputs:
            _put_back(self._processor, "process_inputs", _live(self._before[2]))

    def __repr__(self) -> str:
        return f"Stage0Scoping(hasher={self.hasher!r}, balancer={self.balancer!r})"


def _leaving(process_inputs: object) -> Stage0Scoping | None:
    """The installation whose ``process_inputs`` this is, if its uninstall waits for its
    requests in flight: a new installation wraps the engine's own instead."""
    owner = getattr(process_inputs, "__self__", None)
    if isinstance(owner, Stage0Scoping) and owner._uninstalling:
        return owner
    return None


def _live(process_inputs: object) -> object:
    """``process_inputs``, or what it wraps where it is the wrapper of an installation
    uninstalled since (another engine's, sharing this input processor, which found this
    one's on top and so left its own under it)."""
    owner = getattr(process_inputs, "__self__", None)
    seen: set[int] = set()
    while isinstance(owner, Stage0Scoping) and not owner._installed and not owner._uninstalling:
        if id(owner) in seen:  # never: each wraps what was there before it
            raise RuntimeError("stage-0 installations wrap each other's process_inputs")
        seen.add(id(owner))
        process_inputs = owner._before[2]
        owner = getattr(process_inputs, "__self__", None)
    return process_inputs


def _put_back(owner: Any, name: str, before: object) -> None:
    """``owner.name`` as it was before the installation (its class's, if it had none)."""
    if before is _MISSING:
        owner.__dict__.pop(name, None)
    else:
        setattr(owner, name, before)


def _bind(pool: Any, request_id: str | None, replica: int) -> None:
    """Bind ``request_id`` to ``replica`` in a local pool, so its submission goes there.

    The pool's ``select_replica_id`` (which submission calls) returns a request's bound
    replica; ``bind`` records one by the replica's input address.
    """
    client = pool.clients[replica]
    address = type(pool)._client_input_addr(client)
    if request_id is None or address is None or pool.get_replica_id_by_addr(address) != replica:
        raise RuntimeError(
            f"cannot bind request {request_id!r} to stage-0 replica {replica}: it has no input address"
        )
    pool.bind(request_id, address)


def install_stage0_scoping(
    engine: Any,
    *,
    balancer: LoadBalancer | None = None,
    hasher: MediaHasher | None = None,
) -> Stage0Scoping:
    """Make a running vllm-omni ``AsyncOmniEngine`` scope stage-0 media keys with :func:`scope_stage0`.

    After this, the engine never writes into the caller's prompt (dicts and lists stay
    as they were; records are immutable anyway), a template reused, copied or retried
    gets the keys a fresh request would get, and records may be sent where prompt dicts
    were (``Omni.generate(record)``).

    ``balancer`` chooses stage 0's replica: vllm-omni's load-balancer protocol
    (``select(task, replicas) -> index``), e.g. ``Stage0Balancer(CacheAffinity())``. It is
    attached to stage 0's pool, whose distributed ``pick`` then uses it too; in a local
    pool the scoping asks it with the live, available replica ids and binds the request
    to its choice. Without one, the pool chooses as before (round robin locally).

    ``hasher`` defaults to the engine's: ``MediaHasher(<its model string>, <stage 0's
    mm_hasher_algorithm>)``. Undo with :meth:`Stage0Scoping.uninstall`.
    """
    for name in ("stage_pools", "input_processor", _HELPER, _BUILD):
        if not hasattr(engine, name):
            raise PromptTypeError(
                "engine", f"must be a vllm-omni AsyncOmniEngine (it has no {name}), got {type_name(engine)}"
            )
    if not engine.stage_pools:
        raise PromptTypeError("engine", "has no stage pools: start it before installing")
    if engine.input_processor is None:  # vllm-omni's where stage 0 has no vLLM config
        raise PromptTypeError(
            "engine", "has no input processor (its stage 0 is a diffusion stage): it keys no media to scope"
        )
    if hasher is None:
        hasher = MediaHasher(str(engine.model), engine._resolve_mm_hasher_algorithm())
    elif not isinstance(hasher, MediaHasher):
        raise PromptTypeError("hasher", f"must be a MediaHasher, got {type_name(hasher)}")
    if balancer is not None and not callable(getattr(balancer, "select", None)):
        raise PromptTypeError("balancer", f"must have select(task, replicas), got {type_name(balancer)}")
    return Stage0Scoping(engine, hasher, balancer).install()
