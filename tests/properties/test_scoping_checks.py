"""omni_requests.testing: the checks pass on correct scoping and catch each kind of broken one."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from PIL import Image
from pyrsistent import PVector

from omni_requests import TextPrompt, scope_to_replica, testing
from omni_requests import strategies as S
from omni_requests.testing import PROPERTIES, ScopingPropertyError, check_scoping
from omni_requests_vllm import from_vllm, to_vllm

from . import _scopers

# Passing checks search at random: any input they find broken is a real bug.
SEARCH = settings(max_examples=10, database=None, suppress_health_check=[HealthCheck.too_slow])
# Checks expected to fail replay the same search every run, so they cannot flake; most
# skip shrinking, which only makes the counter-example smaller.
REPLAY = settings(max_examples=25, database=None, derandomize=True)
FIND = settings(REPLAY, max_examples=100, phases=[Phase.explicit, Phase.generate])


def test_passes_on_our_scope_to_replica() -> None:
    check_scoping(_scopers.ours, settings=SEARCH)


def test_passes_on_our_scoping_behind_a_dict_engine() -> None:
    check_scoping(_scopers.ours_through_dicts, to_dict=to_vllm, settings=SEARCH)


def test_passes_on_a_shallow_copy_scoping() -> None:
    check_scoping(_scopers.shallow_copy, to_dict=to_vllm, settings=SEARCH)


def test_passes_on_a_function_that_returns_the_replica_it_chose() -> None:
    check_scoping(_scopers.shallow_copy_choosing, to_dict=to_vllm, settings=SEARCH)


def test_a_function_whose_keys_name_another_replica_than_it_returned_fails() -> None:
    # docs/property-testing.md: the keys must name the replica the function returned.
    def lying(prompt: dict[str, Any], replica: int) -> tuple[int, dict[str, Any]]:
        return (replica + 1) % 2, _scopers.shallow_copy(prompt, replica)

    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(lying, to_dict=to_vllm, properties=["one_scope_prefix"], settings=REPLAY)
    assert caught.value.properties == ("one_scope_prefix",)


def test_a_cache_that_fails_only_across_examples_is_still_reported_by_property() -> None:
    # An id()-keyed cache goes wrong only when a later example's item gets a dead one's
    # id: Hypothesis then cannot make the failure come again, and it surfaced as its
    # FlakyFailure, not a ScopingPropertyError, so no property was named and the rest were
    # never searched (found by a review, helper-89: 11 of 12 runs).
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(_scopers.cache_by_item_id(), to_dict=to_vllm, settings=REPLAY)
    assert set(caught.value.properties) <= set(PROPERTIES) and caught.value.properties


def test_a_function_that_freezes_the_callers_arrays_changes_the_caller() -> None:
    # The snapshot compared an array's dtype, shape and bytes, not whether the caller can
    # still write it (helper-89).
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(
            _scopers.freeze_callers_arrays, to_dict=to_vllm, properties=["caller_unchanged"], settings=REPLAY
        )
    assert caught.value.properties == ("caller_unchanged",)


def _with_malformed_exif(seed: int) -> TextPrompt:
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8))
    image.info["exif"] = b"garbage!"  # getexif() raises SyntaxError; vLLM's parser tolerates it
    return TextPrompt(prompt="x", multi_modal_data={"image": image})


def test_passes_over_images_whose_exif_is_malformed() -> None:
    templates = st.integers(0, 2**16).map(_with_malformed_exif)
    check_scoping(_scopers.ours, prompts=templates, settings=SEARCH)
    check_scoping(_scopers.ours_through_dicts, to_dict=to_vllm, prompts=templates, settings=SEARCH)


def _set_transparency(image: Image.Image) -> None:
    image.info["transparency"] = 0


def _turn(image: Image.Image) -> None:
    image.getexif()[0x0112] = 6  # vLLM's parser turns it


@pytest.mark.parametrize(
    ("change", "part"),
    [(_set_transparency, "info"), (_turn, "EXIF orientation and ImageID")],
    ids=["transparency", "orientation"],
)
def test_an_engine_that_changes_what_vllms_parser_reads_of_an_image_is_caught(
    change: Callable[[Image.Image], None], part: str
) -> None:
    # Pixels alone are not the image vLLM parses: a changed transparency or orientation
    # is other media to the model, under the key the caller's dict was given.
    def changes_images(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
        for item in prompt["multi_modal_data"].get("image", []):
            if isinstance(item, Image.Image):
                change(item)
        return _scopers.shallow_copy(prompt, replica)

    images = S.text_prompts(modalities=["image"], media=True, user_uuids=False, none_items=False)
    with pytest.raises(
        ScopingPropertyError,
        match=rf"changed the (template|copy \d)'s prompt: \S+: the image's {part} changed",
    ):
        check_scoping(
            changes_images, to_dict=to_vllm, prompts=images, properties=["caller_unchanged"], settings=FIND
        )


def test_passes_on_another_stage_and_more_replicas() -> None:
    def stage2(prompt: Any, replica: int) -> Any:
        return scope_to_replica(prompt, replica, hasher=_scopers.HASHER, stage_id=2)

    check_scoping(stage2, stage_id=2, replicas=3, settings=SEARCH, properties=["one_scope_prefix"])


SHOWN = ("distinct_media_distinct_keys", "one_scope_prefix")


def test_the_old_write_back_fails_with_a_readable_counter_example() -> None:
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(_scopers.old_write_back, to_dict=to_vllm, settings=REPLAY, properties=SHOWN)
    error = caught.value
    message = str(error)
    print(message)  # shown with -s: what a user sees
    assert error.properties == SHOWN
    # The double prefix the bug produced: a key scoped, written back, and scoped again.
    assert re.search(r"stage0:rep\d:stage0:rep\d:[0-9a-f]{8}…", message)
    # The bug itself: a copy with new media, sent after the template, got the template's key.
    distinct = message[message.index("scoping property 'distinct_media_distinct_keys'") :]
    assert re.search(r"copy 1 \w+\[0\] on replica \d \(content #\w+\)\n +step 3: template", distinct)
    # Shrunk to the smallest story: the template is sent, one copy is sent, one retry.
    prefix = message[message.index("scoping property 'one_scope_prefix'") :]
    calls = prefix[prefix.index("calls:") : prefix.index("keys each call gave:")]
    assert calls.count("fn(") == 3, calls


def test_a_changed_caller_is_shown_where_it_changed() -> None:
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(
            _scopers.old_write_back, to_dict=to_vllm, properties=["caller_unchanged"], settings=FIND
        )
    assert re.search(r"step 1 changed the template's prompt: \$\.multi_modal_uuids\S*: ", str(caught.value))


# Each property, and a plausible mistake that breaks it (several break more than one).
BROKEN: list[tuple[str, Callable[..., Any], bool]] = [
    ("caller_unchanged", _scopers.old_write_back, True),
    ("caller_unchanged", _scopers.scope_in_place, False),
    ("distinct_media_distinct_keys", _scopers.hash_shape_only, True),
    ("distinct_media_distinct_keys", _scopers.old_write_back, True),
    ("equal_media_equal_keys", _scopers.key_by_object_identity, True),
    ("replicas_distinct_keys", _scopers.ignore_replica, True),
    ("one_scope_prefix", _scopers.wrong_stage, True),
    ("one_scope_prefix", _scopers.ignore_replica, True),
    ("rescoping_keeps_base", _scopers.old_write_back, True),
    ("rescoping_keeps_base", _scopers.key_by_object_identity, True),
    ("user_uuids_kept", _scopers.hash_despite_uuid, True),
    ("none_items_kept", _scopers.drop_none_items, True),
    ("media_kept", _scopers.stale_media_cache(), True),
]


@pytest.mark.parametrize(
    ("prop", "fn", "dicts"), BROKEN, ids=[f"{prop}-{fn.__name__}" for prop, fn, _ in BROKEN]
)
def test_each_property_catches_a_broken_function(prop: str, fn: Callable[..., Any], dicts: bool) -> None:
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(fn, to_dict=to_vllm if dicts else None, properties=[prop], settings=FIND)
    assert caught.value.properties == (prop,)
    message = str(caught.value)
    assert message.startswith(f"scoping property {prop!r} failed: {PROPERTIES[prop]}")
    assert "Counter-example (shrunk by Hypothesis):" in message and "keys each call gave:" in message


def test_every_property_is_shown_to_fail() -> None:
    assert {prop for prop, _, _ in BROKEN} == set(PROPERTIES)


@pytest.mark.parametrize(
    ("fn", "broken", "may_break"),
    [
        (_scopers.hash_shape_only, {"distinct_media_distinct_keys"}, set()),
        # Dropping a None moves the items after it, each then sent under its neighbour's
        # key: media_kept fails too where the search draws a None before another item
        # (15 examples do not always; CI once drew none).
        (_scopers.drop_none_items, {"none_items_kept"}, {"media_kept"}),
        (_scopers.stale_media_cache(), {"media_kept"}, set()),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_a_mistake_breaks_only_what_it_breaks(
    fn: Callable[..., Any], broken: set[str], may_break: set[str]
) -> None:
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(fn, to_dict=to_vllm, settings=settings(FIND, max_examples=15))
    assert broken <= set(caught.value.properties) <= broken | may_break


def test_an_exception_from_the_function_is_not_taken_for_a_property() -> None:
    def crashes(prompt: Any, replica: int) -> Any:
        raise RuntimeError("engine down")

    with pytest.raises(RuntimeError, match="engine down"):
        check_scoping(crashes, settings=FIND)


def test_a_function_that_scopes_in_place_is_told_how_to_be_checked() -> None:
    def in_place(prompt: dict[str, Any], replica: int) -> None:
        _scopers.old_write_back(prompt, replica)

    with pytest.raises(TypeError, match=r"returned None; .*\(fn\(prompt, replica\), prompt\)\[1\]"):
        check_scoping(in_place, to_dict=to_vllm, settings=FIND)
    with pytest.raises(ScopingPropertyError, match="caller_unchanged"):
        check_scoping(
            lambda p, r: (in_place(p, r), p)[1],
            to_dict=to_vllm,
            properties=["caller_unchanged"],
            settings=FIND,
        )


def test_a_result_of_the_wrong_kind_is_named() -> None:
    with pytest.raises(TypeError, match="returned dict, expected a prompt record"):
        check_scoping(lambda p, r: {}, settings=FIND)
    with pytest.raises(TypeError, match=r"returned \S*Prompt, expected a prompt dict"):
        check_scoping(lambda p, r: _scopers.ours(from_vllm(p), r), to_dict=to_vllm, settings=FIND)


def test_prompts_can_be_narrowed_to_what_an_engine_supports() -> None:
    images_only = S.text_prompts(modalities=["image"], media=True, user_uuids=False, none_items=False)
    seen: set[str] = set()

    def spy(prompt: Any, replica: int) -> Any:
        seen.update(prompt.multi_modal_data)
        return _scopers.ours(prompt, replica)

    check_scoping(spy, prompts=images_only, properties=["one_scope_prefix"], settings=SEARCH)
    assert seen == {"image"}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"properties": ["one_prefix"]}, ValueError, "properties must be some of caller_unchanged"),
        ({"properties": []}, ValueError, "properties must be some of"),
        ({"replicas": 1}, ValueError, "replicas must be an int >= 2, got 1"),
        ({"stage_id": -1}, ValueError, "stage_id must be an int >= 0"),
        ({"max_calls": True}, ValueError, "max_calls must be an int >= 3, got True"),
        ({"prompts": [1]}, TypeError, "prompts must be a Hypothesis strategy"),
        ({"to_dict": "to_vllm"}, TypeError, "to_dict must be callable"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        check_scoping(_scopers.ours, **kwargs)
    with pytest.raises(TypeError, match="fn must be callable"):
        check_scoping("scope_to_replica")  # type: ignore[arg-type]


def test_a_single_property_name_is_accepted() -> None:
    check_scoping(_scopers.ours, properties="one_scope_prefix", settings=SEARCH)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fn", "to_dict"),
    [(_scopers.ours, None), (_scopers.ours_through_dicts, to_vllm), (_scopers.shallow_copy, to_vllm)],
    ids=["records", "records-behind-dicts", "shallow-copy"],
)
def test_checks_pass_over_many_examples_of_every_prompt_kind(fn: Callable[..., Any], to_dict: Any) -> None:
    every_kind = S.prompts(kinds=("text", "tokens", "embeds"), media=True, embeddings=True)
    long = settings(SEARCH, max_examples=300)
    check_scoping(fn, to_dict=to_dict, prompts=every_kind, replicas=3, settings=long)


def test_equal_media_means_equal_as_given_and_as_the_model_sees_them() -> None:
    # Found by the random search: two images sharing an EXIF ImageID but not their pixels
    # are one item to vLLM's direct hasher, two to the model (vLLM's parser drops the ID).
    # Our keys follow the model; the check must not demand one key for them.
    def tagged(height: int) -> Image.Image:
        image = Image.new("RGB", (1, height))
        image.getexif()[0x800D] = uuid.UUID(int=0)
        return image

    template = TextPrompt(prompt="<image>", multi_modal_data={"image": tagged(2)})
    scenario = testing._Scenario(
        template=template,
        copies=(attrs.evolve(template, multi_modal_data={"image": tagged(1)}),),
        rebuilt=TextPrompt(prompt="<image>", multi_modal_data={"image": tagged(2)}),
        calls=(testing._Call(0, 0, False), testing._Call(1, 0, False), testing._Call(2, 0, False)),
    )
    trace = testing._run(_scopers.ours, testing._Records(), scenario)
    keys = [obs.result.keys["image"][0] for obs in trace.observations]  # type: ignore[index]
    assert keys[0] == keys[2] != keys[1]  # the rebuilt template keys like the template
    ctx = testing._Context(_scopers.ours, testing._Records(), 0)
    assert testing._CHECKS["equal_media_equal_keys"](trace, ctx) is None
    assert testing._CHECKS["distinct_media_distinct_keys"](trace, ctx) is None


def test_each_checked_function_and_property_has_its_own_example_database_key() -> None:
    # Hypothesis keys its example database by the inner test function; every property's
    # search is the same nested function, so without a per-search digest all of them,
    # for every checked function, would share one key and replay each other's failures.
    from hypothesis.database import InMemoryExampleDatabase

    db = InMemoryExampleDatabase()
    saving = settings(max_examples=25, database=db, phases=[Phase.generate])
    for fn in (_scopers.ignore_replica, _scopers.wrong_stage):
        for prop in ("one_scope_prefix", "replicas_distinct_keys"):
            with contextlib.suppress(ScopingPropertyError):
                check_scoping(fn, to_dict=to_vllm, properties=[prop], settings=saving)
    # A failing search saves its shrunk example under its key (secondary keys extend it).
    saved = {key for key, values in db.data.items() if values and not key.endswith(b".secondary")}
    assert len(saved) == 3, saved  # wrong_stage keeps replicas apart: three searches failed


# -- vllm-omni's own helper -----------------------------------------------------------------


@pytest.fixture(scope="module")
def omni_helper() -> Callable[..., None]:
    pytest.importorskip("vllm.multimodal.hasher")
    if importlib.util.find_spec("vllm_omni") is None:
        pytest.skip("vllm-omni is not installed")
    return _scopers.vllm_omni_helper()


def _has_exif_image_id(value: object) -> bool:
    if isinstance(value, Image.Image):
        return isinstance(value.getexif().get(0x800D), uuid.UUID)
    if isinstance(value, (list, tuple, PVector)):
        return any(_has_exif_image_id(v) for v in value)
    return False


@pytest.mark.vllm
def test_passes_on_vllm_omnis_own_helper_run_on_a_shallow_copy(omni_helper: Callable[..., None]) -> None:
    # The helper leaves UUIDs of a modality without data unscoped, and vLLM ignores them
    # (no item, so no key): the kit must not judge them as keys. Images and video frames
    # with an EXIF ImageID are left out: the helper keys them by it, which the engine does
    # not (next two tests).
    no_image_ids = S.prompts(kinds=("text", "tokens"), media=True).filter(
        lambda p: not any(_has_exif_image_id(v) for v in p.multi_modal_data.values())
    )
    fn = _scopers.vllm_omni_shallow_copy(omni_helper)
    check_scoping(fn, to_dict=to_vllm, prompts=no_image_ids, settings=SEARCH)


@pytest.mark.vllm
def test_vllm_omnis_helper_keys_two_images_by_one_exif_image_id(omni_helper: Callable[..., None]) -> None:
    # A finding, not a kit bug: the helper hashes an image as given, so vLLM's hasher keys
    # it by its EXIF ImageID alone; vLLM's parser drops the ID and the model sees the
    # pixels. Two images with one ID and other pixels get one key: stale features.
    def tagged(height: int) -> Image.Image:
        image = Image.new("RGB", (1, height))
        image.getexif()[0x800D] = uuid.UUID(int=0)
        return image

    template = TextPrompt(prompt="<image>", multi_modal_data={"image": tagged(2)})
    scenario = testing._Scenario(
        template=template,
        copies=(attrs.evolve(template, multi_modal_data={"image": tagged(1)}),),
        rebuilt=TextPrompt(prompt="<image>", multi_modal_data={"image": tagged(2)}),
        calls=(testing._Call(0, 0, False), testing._Call(1, 0, False)),
    )
    fn = _scopers.vllm_omni_shallow_copy(omni_helper)
    world = testing._Dicts(to_vllm)
    trace = testing._run(fn, world, scenario)
    problem = testing._CHECKS["distinct_media_distinct_keys"](trace, testing._Context(fn, world, 0))
    assert problem is not None and "different media got the same key" in problem


@pytest.mark.vllm
def test_vllm_omnis_helper_keys_two_videos_by_their_frames_exif_image_id(
    omni_helper: Callable[..., None],
) -> None:
    # The same finding for video: vLLM's hasher keys a list of PIL frames by each frame's
    # ImageID, yet vLLM's parser stacks the frames into one array (the IDs gone). Two
    # videos whose frames share an ID get one key: the second is served the first's
    # features. Our scoping keys the pixels (test_trust.py).
    def tagged(gray: int) -> list[Image.Image]:
        frames = [Image.new("RGB", (2, 2), (gray, gray, gray)) for _ in range(2)]
        for frame in frames:
            frame.getexif()[0x800D] = uuid.UUID(int=0)
        return frames

    template = TextPrompt(prompt="<video>", multi_modal_data={"video": [tagged(0)]})
    scenario = testing._Scenario(
        template=template,
        copies=(attrs.evolve(template, multi_modal_data={"video": [tagged(255)]}),),
        rebuilt=TextPrompt(prompt="<video>", multi_modal_data={"video": [tagged(0)]}),
        calls=(testing._Call(0, 0, False), testing._Call(1, 0, False)),
    )
    world = testing._Dicts(to_vllm)
    for fn, stale in (
        (_scopers.vllm_omni_shallow_copy(omni_helper), True),
        (_scopers.ours_through_dicts, False),
    ):
        trace = testing._run(fn, world, scenario)
        problem = testing._CHECKS["distinct_media_distinct_keys"](trace, testing._Context(fn, world, 0))
        assert (problem is not None and "different media got the same key" in problem) is stale, problem


@pytest.mark.vllm
def test_fails_vllm_omnis_own_helper_writing_back(omni_helper: Callable[..., None]) -> None:
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(_scopers.vllm_omni_write_back(omni_helper), to_dict=to_vllm, settings=FIND)
    assert {"caller_unchanged", "one_scope_prefix"} <= set(caught.value.properties)


def test_uuids_of_a_modality_without_data_are_not_judged_as_keys() -> None:
    # vLLM accepts them and ignores them: no item, so no key. A scoping function may
    # leave them as they are (vllm-omni's helper does) or drop them.
    template = TextPrompt(
        prompt="<image>",
        multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
        multi_modal_uuids={"video": ["clip-a"]},
    )
    scenario = testing._Scenario(
        template=template,
        copies=(),
        rebuilt=template,
        calls=(testing._Call(0, 0, False), testing._Call(0, 1, False)),
    )

    def leave_them(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
        scoped = _scopers.shallow_copy(prompt, replica)
        return {**scoped, "multi_modal_uuids": {**scoped["multi_modal_uuids"], "video": ["clip-a"]}}

    world = testing._Dicts(to_vllm)
    trace = testing._run(leave_them, world, scenario)
    ctx = testing._Context(leave_them, world, 0)
    assert [obs.result.keys["video"] for obs in trace.observations] == [["clip-a"], ["clip-a"]]  # type: ignore[index]
    for name, check in testing._CHECKS.items():
        assert check(trace, ctx) is None, name
