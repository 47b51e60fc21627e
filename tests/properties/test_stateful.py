"""A state machine that reuses prompts the way engine code does, beside a plain model.

It builds templates, copies them with new media, scopes them to replicas and retries
them elsewhere, on records (``scope_to_replica``) and on the caller's own dicts (an
engine's dict function) at once. After every step every key is compared with the key a
plain model computes on its own: ``stage{S}:rep{R}:{uuid or content hash}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from omni_requests import TextPrompt, rendered_uuids, scope_to_replica
from omni_requests import strategies as S
from omni_requests.testing import _copy_media, _snapshot
from omni_requests_vllm import to_vllm

from . import _scopers

HASHER = _scopers.HASHER
Keys = dict[str, list[str]]


@attrs.define
class Entry:
    """A prompt as the record world, the dict world and the model each hold it."""

    record: TextPrompt
    caller: dict[str, Any]
    items: list[tuple[str, str | None, Any]]  # the model: (modality, uuid, own copy of the item)
    record_before: Any
    caller_before: Any


@attrs.define
class Scoped:
    entry: Entry
    record: TextPrompt
    replica: int


@st.composite
def media_with_uuids(draw: st.DrawFn) -> tuple[dict[str, list[Any]], dict[str, list[str | None]]]:
    """New media for a prompt, some items with a user UUID (fresh each time)."""
    data = draw(S.multi_modal_data(max_items=2))
    uuids = {m: [draw(st.none() | st.uuids().map(str)) for _ in items] for m, items in data.items()}
    return data, {m: row for m, row in uuids.items() if any(row)}


class TemplateReuse(RuleBasedStateMachine):
    engine: Callable[..., Any] = staticmethod(_scopers.shallow_copy)

    prompts = Bundle("prompts")
    scoped = Bundle("scoped")

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[Entry] = []
        self.results: list[Scoped] = []
        self.stage = 0
        self.replicas = 2

    # -- the model --------------------------------------------------------------------------

    def expected(self, entry: Entry, replica: int) -> Keys:
        keys: Keys = {}
        for modality, uuid, item in entry.items:
            base = uuid if uuid is not None else HASHER.content_key(modality, item)
            keys.setdefault(modality, []).append(f"stage{self.stage}:rep{replica}:{base}")
        return keys

    def new_entry(self, record: TextPrompt, caller: dict[str, Any], uuids: dict[str, Any]) -> Entry:
        items = [
            (m, (uuids.get(m) or [None] * len(row))[i], _copy_media(item))
            for m, row in record.multi_modal_data.items()
            for i, item in enumerate(row)
        ]
        entry = Entry(record, caller, items, _snapshot(record), _snapshot(caller))
        self.entries.append(entry)
        return entry

    def engine_keys(self, entry: Entry, replica: int) -> Keys:
        out = type(self).engine(entry.caller, replica, stage=self.stage)
        keys: Keys = out["multi_modal_uuids"]
        return keys

    # -- rules ------------------------------------------------------------------------------

    @initialize(stage=st.integers(0, 2), replicas=st.integers(2, 3))
    def layout(self, stage: int, replicas: int) -> None:
        self.stage, self.replicas = stage, replicas

    @rule(target=prompts, media=media_with_uuids())
    def build_template(self, media: tuple[dict[str, Any], dict[str, Any]]) -> Entry:
        data, uuids = media
        record = TextPrompt(prompt="<media> describe", multi_modal_data=data, multi_modal_uuids=uuids)
        caller: dict[str, Any] = {"prompt": "<media> describe", "multi_modal_data": _copy_media(data)}
        if uuids:
            caller["multi_modal_uuids"] = _copy_media(uuids)
        return self.new_entry(record, caller, uuids)

    @rule(target=prompts, source=prompts, media=media_with_uuids())
    def copy_with_new_media(self, source: Entry, media: tuple[dict[str, Any], dict[str, Any]]) -> Entry:
        """``attrs.evolve`` of the record; ``{**template, ...}`` of the caller's used dict."""
        data, uuids = media
        changes: dict[str, Any] = {"multi_modal_data": data}
        caller = {**source.caller, "multi_modal_data": _copy_media(data)}
        if uuids:
            changes["multi_modal_uuids"] = uuids
            caller["multi_modal_uuids"] = _copy_media(uuids)
        elif source.record.multi_modal_uuids:
            changes["multi_modal_uuids"] = None  # the source's UUIDs belong to its own items
            caller.pop("multi_modal_uuids", None)
        return self.new_entry(attrs.evolve(source.record, **changes), caller, uuids)

    @rule(target=scoped, source=prompts, replica=st.integers(0, 2))
    def scope(self, source: Entry, replica: int) -> Scoped:
        replica %= self.replicas
        record = scope_to_replica(source.record, replica, hasher=HASHER, stage_id=self.stage)
        assert rendered_uuids(record) == self.expected(source, replica)
        assert self.engine_keys(source, replica) == self.expected(source, replica)
        result = Scoped(source, record, replica)
        self.results.append(result)
        return result

    @rule(target=scoped, previous=scoped, replica=st.integers(0, 2))
    def retry_elsewhere(self, previous: Scoped, replica: int) -> Scoped:
        """A retry: the scoped record scoped again, and the caller's dict sent again."""
        replica %= self.replicas
        record = scope_to_replica(previous.record, replica, hasher=HASHER, stage_id=self.stage)
        assert rendered_uuids(record) == self.expected(previous.entry, replica)
        assert self.engine_keys(previous.entry, replica) == self.expected(previous.entry, replica)
        result = Scoped(previous.entry, record, replica)
        self.results.append(result)
        return result

    @rule(sent=scoped)
    def engine_changes_what_it_was_sent(self, sent: Scoped) -> None:
        """The engine gets a dict and may change it; the record must not notice."""
        prompt = to_vllm(sent.record)
        assert prompt["multi_modal_uuids"] == self.expected(sent.entry, sent.replica)
        for modality, keys in prompt["multi_modal_uuids"].items():
            keys[0] = "changed-by-engine"
            prompt["multi_modal_data"][modality].append(None)

    # -- after every step -----------------------------------------------------------------------

    @invariant()
    def nothing_a_caller_holds_has_changed(self) -> None:
        for entry in self.entries:
            assert _snapshot(entry.record) == entry.record_before
            assert _snapshot(entry.caller) == entry.caller_before, "the engine changed the caller's dict"

    @invariant()
    def every_key_matches_the_model(self) -> None:
        for result in self.results:
            assert rendered_uuids(result.record) == self.expected(result.entry, result.replica)
        for entry in self.entries:
            assert entry.record.scope is None
            assert rendered_uuids(entry.record) == (
                {m: list(u) for m, u in entry.record.multi_modal_uuids.items()} or None
            )


TemplateReuse.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_template_reuse = TemplateReuse.TestCase


def _machine_with(engine: Callable[..., Any]) -> type[TemplateReuse]:
    """The same story, with the caller's dicts scoped by ``engine`` (stage 0 only)."""

    def stage_zero(prompt: dict[str, Any], replica: int, *, stage: int) -> Any:
        return engine(prompt, replica)

    return type(
        f"TemplateReuseWith_{engine.__name__}", (TemplateReuse,), {"engine": staticmethod(stage_zero)}
    )


@pytest.mark.parametrize(
    "engine",
    [_scopers.old_write_back, _scopers.key_by_object_identity, _scopers.ignore_replica],
    ids=lambda engine: engine.__name__,
)
def test_the_machine_catches_a_broken_engine(engine: Callable[..., Any]) -> None:
    quick = settings(
        max_examples=30,
        stateful_step_count=10,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(_machine_with(engine), settings=quick)


@pytest.mark.slow
def test_template_reuse_over_many_steps() -> None:
    long = settings(TemplateReuse.TestCase.settings, max_examples=300, stateful_step_count=40)
    run_state_machine_as_test(TemplateReuse, settings=long)
