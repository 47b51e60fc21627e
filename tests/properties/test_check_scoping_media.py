"""media_kept: a scoped prompt must send the media its keys were judged for.

The key properties judge each returned key against the caller's item in its place. A
function that computes those keys right but sends other media (a cache's, the used
template's) passes all of them, yet the engine caches the other media's features under
the copy's keys: the stale-key bug, from the other side. ``media_kept`` compares what
the scoped prompt sends with what the caller gave, by content, as the key properties
compare "equal media".
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

from omni_requests import TextPrompt, testing
from omni_requests import strategies as S
from omni_requests.testing import PROPERTIES, ScopingPropertyError, check_scoping
from omni_requests_vllm import to_vllm

from . import _scopers

SEARCH = settings(max_examples=30, database=None, suppress_health_check=[HealthCheck.too_slow])
REPLAY = settings(max_examples=25, database=None, derandomize=True)
FIND = settings(REPLAY, phases=[Phase.explicit, Phase.generate])  # the problem, unshrunk


def test_media_kept_is_a_property() -> None:
    assert "media_kept" in PROPERTIES


def test_a_function_that_sends_cached_media_under_fresh_keys_fails_only_media_kept() -> None:
    # Every key is right for the caller's item, so every key property holds; a copy goes
    # out with the template's media under its own keys (the cache lives across examples,
    # so the first stale item found may be any prompt's).
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(_scopers.stale_media_cache(), to_dict=to_vllm, settings=REPLAY)
    assert caught.value.properties == ("media_kept",)
    message = str(caught.value)
    assert message.startswith(f"scoping property 'media_kept' failed: {PROPERTIES['media_kept']}")
    assert re.search(
        r"step \d+: (template|copy \d+|rebuilt) \w+\[\d+\] on replica \d+ is sent as .+#[0-9a-f]{6}, "
        r"but the caller gave content #[0-9a-f]{6} there; its key '\S+' names the caller's item",
        message,
    ), message


def _story(template: TextPrompt, copy: TextPrompt) -> testing._Scenario:
    return testing._Scenario(
        template=template,
        copies=(copy,),
        rebuilt=template,
        calls=(testing._Call(0, 0, False), testing._Call(1, 1, False)),
    )


def _media_kept(fn: Callable[..., Any], scenario: testing._Scenario) -> str | None:
    world = testing._Dicts(to_vllm)
    trace = testing._run(fn, world, scenario)
    return testing._CHECKS["media_kept"](trace, testing._Context(fn, world, 0))


def test_a_user_uuid_does_not_hide_stale_media() -> None:
    # The copy names its new image with a new UUID: its key is right ("stage0:rep1:cat-2"),
    # but the image sent is the template's. Content is compared, not the UUID.
    template = TextPrompt(
        prompt="<image>",
        multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
        multi_modal_uuids={"image": ["cat-1"]},
    )
    copy = attrs.evolve(
        template,
        multi_modal_data={"image": np.ones((2, 2, 3), np.uint8)},
        multi_modal_uuids={"image": ["cat-2"]},
    )
    problem = _media_kept(_scopers.stale_media_cache(), _story(template, copy))
    assert problem is not None and "step 2: copy 1 image[0] on replica 1 is sent as" in problem, problem
    assert "'stage0:rep1:cat-2'" in problem
    assert _media_kept(_scopers.ours_through_dicts, _story(template, copy)) is None


def _equal_copies(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Scopes right and sends equal copies of the caller's media, in other objects and layouts."""
    out = _scopers.shallow_copy(prompt, replica)
    data = out.get("multi_modal_data")
    if data:
        out["multi_modal_data"] = {
            m: [
                np.asfortranarray(x) if isinstance(x, np.ndarray) and x.ndim > 1 else testing._copy_media(x)
                for x in _scopers._as_list(v)
            ]
            for m, v in data.items()
        }
    return out


def test_equal_media_in_new_objects_is_kept_media() -> None:
    # The engine keys and sees content: an equal copy in a new object, a Fortran-order
    # array for a C-order one, is the same item and keeps its key.
    check_scoping(_equal_copies, to_dict=to_vllm, properties=["media_kept"], settings=SEARCH)


def _adds_an_item(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    out = _scopers.shallow_copy(prompt, replica)
    data = out.get("multi_modal_data")
    if data:
        modality, items = next(iter(data.items()))
        out["multi_modal_data"] = {
            **data,
            modality: [*_scopers._as_list(items), np.zeros((1, 1, 3), np.uint8)],
        }
    return out


def _drops_the_media(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    out = _scopers.shallow_copy(prompt, replica)
    out.pop("multi_modal_data", None)
    return out


def _swaps_the_first_two(prompt: dict[str, Any], replica: int) -> dict[str, Any]:
    """Keys in the caller's order, items in another: each key is sent with its neighbour."""
    out = _scopers.shallow_copy(prompt, replica)
    data = out.get("multi_modal_data")
    if data:
        out["multi_modal_data"] = {
            m: _scopers._as_list(v)[1::-1] + _scopers._as_list(v)[2:] for m, v in data.items()
        }
    return out


@pytest.mark.parametrize(
    ("fn", "problem"),
    [
        (_adds_an_item, "an item the caller did not give"),
        (_drops_the_media, "is missing from the scoped prompt's multi_modal_data"),
        (_swaps_the_first_two, "is sent as"),
    ],
    ids=["adds-an-item", "drops-the-media", "swaps-two-items"],
)
def test_media_added_dropped_or_moved_fails(fn: Callable[..., Any], problem: str) -> None:
    with pytest.raises(ScopingPropertyError) as caught:
        check_scoping(fn, to_dict=to_vllm, properties=["media_kept"], settings=FIND)
    assert caught.value.properties == ("media_kept",)
    assert problem in str(caught.value)


EVERY_KIND = S.prompts(kinds=("text", "tokens", "embeds"), media=True, embeddings=True)


@pytest.mark.parametrize(
    ("fn", "to_dict", "prompts"),
    [
        (_scopers.ours, None, EVERY_KIND),
        (_scopers.ours_through_dicts, to_vllm, EVERY_KIND),
        (_scopers.shallow_copy, to_vllm, None),
        (_scopers.shallow_copy_choosing, to_vllm, None),
    ],
    ids=["records", "records-behind-dicts", "shallow-copy", "shallow-copy-choosing"],
)
def test_correct_functions_keep_the_media(fn: Callable[..., Any], to_dict: Any, prompts: Any) -> None:
    check_scoping(fn, to_dict=to_dict, prompts=prompts, properties=["media_kept"], settings=SEARCH)


@pytest.mark.vllm
def test_vllm_omnis_helper_on_a_shallow_copy_keeps_the_media() -> None:
    pytest.importorskip("vllm.multimodal.hasher")
    if importlib.util.find_spec("vllm_omni") is None:
        pytest.skip("vllm-omni is not installed")
    fn = _scopers.vllm_omni_shallow_copy(_scopers.vllm_omni_helper())
    check_scoping(fn, to_dict=to_vllm, properties=["media_kept"], settings=SEARCH)
