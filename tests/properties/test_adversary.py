"""The adversary: every handle it can get, written through between scopings and renders.

A Hypothesis state machine plays a caller (or an engine) that does not play fair. It
holds the caller's arrays, views taken of them before and after freezing, the arrays a
record exposes (``multi_modal_data`` and their ``.base``), the arrays inside the dicts
``to_vllm`` hands out, PIL images and tensors; it flips ``writeable`` flags back and
forth and writes through whatever lets it. After every step, for every record it has
built, each key ``to_vllm`` puts in the engine's dict is compared with the key vLLM's own
hasher gives the item that same dict carries (``MultiModalHasher.hash_kwargs``; where
vLLM is not installed, ours on a fresh private copy, which is proven equal to vLLM's in
``tests/vllm``). A mismatch is a stale key: the engine would serve another item's
features. ``docs/security.md`` reports the size of the run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from PIL import Image

from omni_requests import KeyPolicy, MediaHasher, TextPrompt, scope_to_replica
from omni_requests_vllm import to_vllm

MODEL = "/models/adversary"
HASHER = MediaHasher(MODEL)
UUID_KEYED = "clip"  # one item per record is keyed by this UUID, to check user keys too


def _vllm_key() -> Callable[[str, Any], str]:
    """vLLM's own hasher where it is installed, else ours on a private copy of the item."""
    try:
        from vllm.multimodal.hasher import MultiModalHasher
    except ImportError:
        if os.environ.get("OMNI_REQUESTS_REQUIRE_VLLM"):
            raise

        def ours(modality: str, item: Any) -> str:
            fresh = np.array(item, copy=True) if isinstance(item, np.ndarray) else item
            return HASHER.key(modality, fresh)

        return ours

    def theirs(modality: str, item: Any) -> str:
        digest: str = MultiModalHasher.hash_kwargs("blake3", model_id=MODEL, **{modality: item})
        return digest

    return theirs


VLLM_KEY = _vllm_key()
RUNS = {"sequences": 0, "steps": 0, "keys_checked": 0, "stale": 0}


def _try(action: Callable[[], object]) -> None:
    """Attempt a write or a flag change; numpy refusing it is part of the game."""
    with contextlib.suppress(ValueError):
        action()


class Adversary(RuleBasedStateMachine):
    arrays = Bundle("arrays")
    records = Bundle("records")

    def __init__(self) -> None:
        super().__init__()
        self.built: list[TextPrompt] = []
        self.images: list[Image.Image] = []
        RUNS["sequences"] += 1

    # -- getting handles --

    @rule(target=arrays, seed=st.integers(0, 2**16), frames=st.integers(1, 3), frozen=st.booleans())
    def new_array(self, seed: int, frames: int, frozen: bool) -> np.ndarray[Any, Any]:
        array = np.random.default_rng(seed).integers(0, 256, (frames, 4, 4, 3), dtype=np.uint8)
        array.flags.writeable = not frozen  # frozen the way users freeze: by the flag
        return array

    @rule(target=arrays, array=arrays)
    def take_view_then_freeze(self, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        view = array[:]  # taken while (perhaps) writable, kept after the owner freezes

        def freeze() -> None:
            array.flags.writeable = False

        _try(freeze)
        return view

    @rule(target=arrays, record=records)
    def take_record_arrays(self, record: TextPrompt) -> np.ndarray[Any, Any]:
        item = record.multi_modal_data["video"][0]
        # The array under the record's item, seen in the item's shape (still 4-D video).
        return item.base.reshape(item.shape) if isinstance(item.base, np.ndarray) else item

    @rule(target=arrays, record=records)
    def take_engine_arrays(self, record: TextPrompt) -> np.ndarray[Any, Any]:
        item: np.ndarray[Any, Any] = to_vllm(record)["multi_modal_data"]["video"][-1]
        return item

    @rule(seed=st.integers(0, 255))
    def new_image(self, seed: int) -> None:
        self.images.append(Image.new("RGB", (6, 5), (seed, 255 - seed, 7)))

    # -- attacks --

    @rule(array=arrays, value=st.integers(0, 255))
    def write(self, array: np.ndarray[Any, Any], value: int) -> None:
        def fill() -> None:
            array[...] = value

        _try(fill)

    @rule(array=arrays, value=st.integers(0, 255))
    def unfreeze_write_refreeze(self, array: np.ndarray[Any, Any], value: int) -> None:
        def attack() -> None:
            array.flags.writeable = True
            array[0, 0, 0, 0] = value
            array.flags.writeable = False

        _try(attack)

    @precondition(lambda self: bool(self.images))
    @rule(data=st.data(), value=st.integers(0, 255))
    def draw_on_an_image(self, data: st.DataObject, value: int) -> None:
        image = data.draw(st.sampled_from(self.images))
        image.putpixel((0, 0), (value, value, value))

    # -- building, scoping, swapping media --

    @rule(target=records, array=arrays, also=arrays, keyed=st.booleans())
    def build(self, array: np.ndarray[Any, Any], also: np.ndarray[Any, Any], keyed: bool) -> TextPrompt:
        record = TextPrompt(
            prompt="<video><video>",
            multi_modal_data={"video": [array, also]},
            multi_modal_uuids={"video": [UUID_KEYED if keyed else None, None]},
        )
        self.built.append(record)
        return record

    @precondition(lambda self: bool(self.images))
    @rule(target=records, array=arrays, data=st.data())
    def build_with_image(self, array: np.ndarray[Any, Any], data: st.DataObject) -> TextPrompt:
        image = data.draw(st.sampled_from(self.images))
        record = TextPrompt(prompt="<image><video>", multi_modal_data={"image": image, "video": array})
        self.built.append(record)
        return record

    @rule(target=records, record=records, replica=st.integers(0, 2), bind=st.booleans())
    def scope(self, record: TextPrompt, replica: int, bind: bool) -> TextPrompt:
        policy = KeyPolicy(bind_content=True) if bind and record.scope is None else None
        scoped = scope_to_replica(record, replica, hasher=HASHER, policy=policy)
        self.built.append(scoped)
        return scoped

    @rule(target=records, record=records, array=arrays)
    def swap_media(self, record: TextPrompt, array: np.ndarray[Any, Any]) -> TextPrompt:
        copy = record.replace_media({"video": [array]})
        self.built.append(copy)
        return copy

    # -- the check --

    @invariant()
    def every_key_is_the_key_of_the_item_sent(self) -> None:
        RUNS["steps"] += 1
        for record in self.built[-6:]:  # the newest records (older ones were checked)
            out = to_vllm(record)
            scope = record.scope
            prefix = "" if scope is None else scope.prefix
            for modality, items in out["multi_modal_data"].items():
                uuids = (out.get("multi_modal_uuids") or {}).get(modality) or [None] * len(items)
                for item, key in zip(items, uuids, strict=True):
                    if scope is None and key is None:
                        continue  # unscoped content keys are vLLM's own to compute
                    if (key is not None and key.endswith(":" + UUID_KEYED)) or key == UUID_KEYED:
                        expected_tail = UUID_KEYED
                        if scope is not None and scope.policy.bind_content:
                            expected_tail = f"bound:{HASHER.fingerprint(modality, item)}:{UUID_KEYED}"
                        expected = prefix + expected_tail
                    else:
                        expected = prefix + VLLM_KEY(modality, item)
                    RUNS["keys_checked"] += 1
                    if key != expected:
                        RUNS["stale"] += 1
                    assert key == expected, f"stale key for {modality}: {key} != {expected}"


def _run(examples: int, steps: int) -> None:
    run_state_machine_as_test(
        Adversary,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )


def test_no_handle_can_make_a_key_stale() -> None:
    before = dict(RUNS)
    _run(examples=100, steps=20)
    assert RUNS["keys_checked"] > before["keys_checked"] and RUNS["stale"] == 0


@pytest.mark.slow
def test_no_handle_can_make_a_key_stale_long() -> None:
    _run(examples=1000, steps=30)
    print(f"adversary: {RUNS}")
