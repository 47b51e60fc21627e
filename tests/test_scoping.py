"""scope_to_replica and media keys: the template-reuse bug cannot happen with records."""

from __future__ import annotations

import copy
import itertools
import pickle

import attrs
import numpy as np
import pytest
from pyrsistent import pmap

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyOrigin,
    KeyPolicy,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
    media_keys,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests._records import _EMPTY, replace_fields

from .conftest import record_calls, video


def _key(prompt: TextPrompt, modality: str = "video", index: int = 0) -> str | None:
    keys = rendered_uuids(prompt)
    assert keys is not None
    return keys[modality][index]


def test_used_template_and_three_copies_over_two_replicas_get_four_distinct_keys(
    hasher: MediaHasher,
) -> None:
    first = video(0)
    template = TextPrompt(prompt="<video> describe", multi_modal_data={"video": first})
    pristine = copy.deepcopy(template)
    replicas = itertools.cycle([0, 1])
    used = scope_to_replica(template, next(replicas), hasher=hasher)  # "went through the engine"
    copies = [attrs.evolve(used, multi_modal_data={"video": video(seed)}) for seed in (1, 2, 3)]
    scoped = [scope_to_replica(c, next(replicas), hasher=hasher) for c in copies]

    keys = [_key(p) for p in [used, *scoped]]
    assert len(set(keys)) == 4
    assert all(k is not None and k.count("stage0:") == 1 for k in keys)
    assert keys[0] == f"stage0:rep0:{hasher.key('video', first)}"
    for seed, key, replica in zip((1, 2, 3), keys[1:], (1, 0, 1), strict=True):
        assert key == f"stage0:rep{replica}:{hasher.key('video', video(seed))}"
    assert template == pristine
    assert template.scope is None
    np.testing.assert_array_equal(template.multi_modal_data["video"][0], video(0))


def test_rescoping_replaces_the_scope_and_keeps_the_base(hasher: MediaHasher) -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    base = hasher.key("video", video(1))
    retried = scope_to_replica(scope_to_replica(p, 0, hasher=hasher), 1, hasher=hasher)
    assert _key(retried) == f"stage0:rep1:{base}"
    again = scope_to_replica(retried, 3, hasher=hasher, stage_id=2)
    assert _key(again) == f"stage2:rep3:{base}"


def test_replacing_media_never_keeps_the_old_media_key(hasher: MediaHasher) -> None:
    old, new = video(1), video(2)
    scoped = scope_to_replica(TextPrompt(prompt="x", multi_modal_data={"video": old}), 1, hasher=hasher)
    copied = attrs.evolve(scoped, multi_modal_data={"video": new})
    assert _key(copied) == f"stage0:rep1:{hasher.key('video', new)}"
    assert hasher.key("video", old) not in str(rendered_uuids(copied))


def test_writes_through_the_callers_array_never_reach_the_record(hasher: MediaHasher) -> None:
    frames = video(1)
    original = frames.copy()
    scoped = scope_to_replica(TextPrompt(prompt="x", multi_modal_data={"video": frames}), 0, hasher=hasher)
    before = _key(scoped)
    frames[:] = 0
    assert _key(scoped) == before == f"stage0:rep0:{hasher.key('video', original)}"
    assert np.array_equal(scoped.multi_modal_data["video"][0], original)


def test_user_uuids_are_the_base_and_none_items_stay_none(hasher: MediaHasher) -> None:
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [np.zeros((2, 2, 3), np.uint8), None, np.ones((2, 2, 3), np.uint8)]},
        multi_modal_uuids={"image": ["cat", "cached-dog", None]},
    )
    keys = media_keys(scope_to_replica(p, 1, hasher=hasher))["image"]
    assert [k.render() if k else None for k in keys] == [
        "stage0:rep1:cat",
        "stage0:rep1:cached-dog",
        f"stage0:rep1:{hasher.key('image', np.ones((2, 2, 3), np.uint8))}",
    ]
    assert [k.origin if k else None for k in keys] == [KeyOrigin.USER, KeyOrigin.USER, KeyOrigin.CONTENT]


def test_uuids_without_data_are_scoped_too(hasher: MediaHasher) -> None:
    # vLLM accepts UUIDs for a modality that sends no data this time (a cache-only reference).
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
        multi_modal_uuids={"audio": "a1"},
    )
    keys = rendered_uuids(scope_to_replica(p, 0, hasher=hasher))
    assert keys is not None and keys["audio"] == ["stage0:rep0:a1"]


def test_unscoped_prompts_render_only_the_callers_uuids() -> None:
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [None, np.zeros((2, 2, 3), np.uint8)]},
        multi_modal_uuids={"image": ["u", None]},
    )
    assert rendered_uuids(p) == {"image": ["u", None]}
    assert rendered_uuids(TextPrompt(prompt="x", multi_modal_data={"image": np.zeros((2, 2, 3))})) is None


def test_unscoped_content_keys_need_a_hasher(hasher: MediaHasher) -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    with pytest.raises(PromptTypeError, match="needs a MediaHasher"):
        media_keys(p)
    key = media_keys(p, hasher)["video"][0]
    assert key is not None and key.scope is None and key.render() == hasher.key("video", video(1))


def test_prompt_without_media_comes_back_as_itself(hasher: MediaHasher) -> None:
    p = TokensPrompt(prompt_token_ids=[1, 2])
    assert scope_to_replica(p, 1, hasher=hasher) is p


def test_same_scope_again_is_the_same_object(hasher: MediaHasher) -> None:
    p = scope_to_replica(TextPrompt(prompt="x", multi_modal_data={"video": video(1)}), 1, hasher=hasher)
    assert scope_to_replica(p, 1, hasher=MediaHasher(hasher.model_id)) is p


def test_scoping_leaves_its_input_untouched(hasher: MediaHasher) -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)}, additional_information={"k": [1]})
    before = copy.deepcopy(p)
    q = scope_to_replica(p, 1, hasher=hasher)
    assert q is not p and p == before and p.scope is None
    assert q.multi_modal_data is p.multi_modal_data  # shared, not copied: it cannot change


def test_encoder_decoder_prompts_scope_their_parts(hasher: MediaHasher) -> None:
    enc = TextPrompt(prompt="x", multi_modal_data={"audio": (np.zeros(8, np.float32), 16000)})
    p = EncoderDecoderPrompt(encoder_prompt=enc, decoder_prompt=TextPrompt(prompt="y"))
    q = scope_to_replica(p, 2, hasher=hasher)
    assert q.encoder_prompt.scope is not None and q.encoder_prompt.scope.replica_id == 2
    assert q.decoder_prompt is p.decoder_prompt
    text_only = EncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="x"))
    assert scope_to_replica(text_only, 2, hasher=hasher) is text_only


def test_a_pair_whose_parts_carry_keys_in_different_scopes_is_not_rendered(hasher: MediaHasher) -> None:
    # One request goes to one replica: to_vllm sent keys scoped to two. Such a pair may
    # be built (a part may carry the pair's policy) and is scoped together before it is sent.
    from omni_requests_vllm import to_vllm

    part = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    on = [scope_to_replica(part, r, hasher=hasher) for r in (0, 1)]
    tenant = scope_to_replica(part, 0, hasher=hasher, policy=KeyPolicy(tenant="acme"))
    for encoder, decoder, found in (
        (on[0], on[1], "scoped to stage0:rep1: under .* while the encoder prompt is scoped to stage0:rep0:"),
        (
            on[0],
            tenant,
            "scoped to stage0:rep0: under .*tenant='acme'.* while the encoder prompt is scoped to",
        ),
        (part, on[0], "scoped to stage0:rep0: .* while the encoder prompt is unscoped"),
    ):
        pair = EncoderDecoderPrompt(encoder_prompt=encoder, decoder_prompt=decoder)
        with pytest.raises(InvalidPromptError, match=rf"^\$\.decoder_prompt: is {found}"):
            to_vllm(pair)
        scoped = to_vllm(scope_to_replica(pair, 1, hasher=hasher))
        keys = [
            scoped[part]["multi_modal_uuids"]["video"][0] for part in ("encoder_prompt", "decoder_prompt")
        ]
        assert all(key.startswith("stage0:rep1:") for key in keys)
    # A part without media keys has no scope to agree on; a hasher of another algorithm
    # scopes to the same replica.
    alone = EncoderDecoderPrompt(encoder_prompt=on[0], decoder_prompt=TextPrompt(prompt="y"))
    assert to_vllm(alone)["decoder_prompt"] == {"prompt": "y"}
    named = TextPrompt(prompt="x", multi_modal_data={"video": video(1)}, multi_modal_uuids={"video": "v"})
    sha = scope_to_replica(named, 0, hasher=MediaHasher(hasher.model_id, "sha256"))
    both = to_vllm(EncoderDecoderPrompt(encoder_prompt=on[0], decoder_prompt=sha))
    assert both["decoder_prompt"]["multi_modal_uuids"] == {"video": ["stage0:rep0:v"]}


@pytest.mark.parametrize(
    ("replica_id", "stage_id", "error", "path"),
    [
        (-1, 0, InvalidPromptError, "replica_id"),
        (True, 0, PromptTypeError, "replica_id"),
        ("1", 0, PromptTypeError, "replica_id"),
        (0, -2, InvalidPromptError, "stage_id"),
    ],
)
def test_bad_scope_arguments(
    hasher: MediaHasher, replica_id: object, stage_id: object, error: type[Exception], path: str
) -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    with pytest.raises(error) as caught:
        scope_to_replica(p, replica_id, hasher=hasher, stage_id=stage_id)  # type: ignore[arg-type]
    assert caught.value.path == path  # type: ignore[attr-defined]


def test_keys_are_read_of_single_records_with_a_media_hasher(hasher: MediaHasher) -> None:
    # AttributeErrors escaped before, naming nothing.
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    for bad, found in (
        (EncoderDecoderPrompt(encoder_prompt=p), "EncoderDecoderPrompt.*each part"),
        ({}, "dict"),
    ):
        for read in (rendered_uuids, media_keys):
            with pytest.raises(
                PromptTypeError, match=rf"^prompt: must be a single prompt record, got .*{found}"
            ):
                read(bad)  # type: ignore[arg-type]
    with pytest.raises(PromptTypeError, match=r"^hasher: must be a MediaHasher or None, got str"):
        media_keys(p, "my-model")  # type: ignore[arg-type]


def test_hasher_must_be_a_media_hasher() -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    with pytest.raises(PromptTypeError, match="MediaHasher"):
        scope_to_replica(p, 0, hasher="m")  # type: ignore[arg-type]


# -- what a template shares with its scoped copies (the render memo) --


def test_renderings_shared_by_scoped_copies_never_reach_a_changed_copy(hasher: MediaHasher) -> None:
    template = TextPrompt(
        prompt="x", multi_modal_data={"video": video(1)}, multi_modal_uuids={"video": "v-1"}
    )
    assert _key(scope_to_replica(template, 1, hasher=hasher)) == "stage0:rep1:v-1"  # remembered now
    renamed = attrs.evolve(template, multi_modal_uuids={"video": "v-2"})
    assert _key(scope_to_replica(renamed, 1, hasher=hasher)) == "stage0:rep1:v-2"
    # The same through the copier scoping uses, changing a field other than the scope.
    unkeyed = replace_fields(scope_to_replica(template, 1, hasher=hasher), multi_modal_uuids=_EMPTY)
    assert _key(unkeyed) == f"stage0:rep1:{hasher.key('video', video(1))}"
    assert _key(scope_to_replica(template, 1, hasher=hasher)) == "stage0:rep1:v-1"


def test_each_scope_renders_its_own_keys_from_one_template(hasher: MediaHasher) -> None:
    template = TextPrompt(prompt="x", multi_modal_data={"image": [None]}, multi_modal_uuids={"image": ["c"]})
    tenant = KeyPolicy(namespaces=True, tenant="acme")
    for _ in range(2):  # the second round is answered from the memo
        assert _key(scope_to_replica(template, 0, hasher=hasher), "image") == "stage0:rep0:c"
        assert _key(scope_to_replica(template, 1, hasher=hasher, stage_id=2), "image") == "stage2:rep1:c"
        scoped = scope_to_replica(template, 0, hasher=hasher, policy=tenant)
        assert _key(scoped, "image") == "stage0:rep0:" + tenant.user_part + "c"


def test_fixed_content_keys_are_derived_once_per_template_and_scope(
    hasher: MediaHasher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A record's own array, its sealed image and tensor (and a built-in value) always read
    # the same: their keys are remembered per scope, as user keys are, not hashed again.
    from PIL import Image

    torch = pytest.importorskip("torch")
    image = Image.fromarray(np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3))
    template = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [image, np.ones((2, 2, 3), np.uint8)], "video": torch.zeros(2, 4, 4, 3)},
    )
    derived = record_calls(monkeypatch, MediaHasher, "_content_key", 2)
    for _ in range(3):
        for replica in (0, 1):
            rendered = rendered_uuids(scope_to_replica(template, replica, hasher=hasher))
            assert rendered == {
                modality: [f"stage0:rep{replica}:{key.base}" for key in keys]
                for modality, keys in media_keys(template, hasher).items()
            }
    # media_keys derives once per hasher (three items), the renders once per scope.
    assert len(derived) == 3 + 3 * 2
    scoped = scope_to_replica(template, 1, hasher=hasher)
    assert media_keys(scoped) == media_keys(scoped) != media_keys(template, hasher)  # keys carry the scope
    assert len(derived) == 3 + 3 * 2 + 3


def test_media_keys_follow_an_item_that_can_change_and_new_media(hasher: MediaHasher) -> None:
    # An unsealed palette image (its holder's writes reach the record) is keyed again at
    # every call; a copy given other media is keyed by its own, never by the memo it shares.
    from PIL import Image

    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 255, 255, 255] * 128)
    arrays = TextPrompt(prompt="x", multi_modal_data={"image": [image, np.ones((2, 2, 3), np.uint8)]})
    for prompt in (arrays, scope_to_replica(arrays, 1, hasher=hasher)):
        before = media_keys(prompt, hasher)["image"]
        image.putpixel((0, 0), 1 - image.getpixel((0, 0)))  # type: ignore[operator]
        after = media_keys(prompt, hasher)["image"]
        assert after[0].base == hasher.content_key("image", image) != before[0].base  # type: ignore[union-attr]
    sealed = TextPrompt(prompt="x", multi_modal_data={"image": np.ones((2, 2, 3), np.uint8)})
    media_keys(sealed, hasher)  # remembered now
    for changed in (
        sealed.replace_media({"image": np.zeros((2, 2, 3), np.uint8)}),
        attrs.evolve(sealed, multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)}),
        scope_to_replica(sealed, 1, hasher=hasher).replace_media({"image": np.zeros((2, 2, 3), np.uint8)}),
    ):
        key = media_keys(changed, hasher)["image"][0]
        assert key is not None and key.base == hasher.content_key("image", np.zeros((2, 2, 3), np.uint8))


def test_items_that_can_change_are_keyed_again_at_every_render(hasher: MediaHasher) -> None:
    # A palette image is kept as given (not sealed), so its holder's writes reach the
    # record: its key, and a binding's fingerprint of it, follow them at every render.
    from PIL import Image

    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 255, 255, 255] * 128)
    keyed = scope_to_replica(TextPrompt(prompt="x", multi_modal_data={"image": image}), 0, hasher=hasher)
    bound = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_data={"image": image}, multi_modal_uuids={"image": "cat"}),
        0,
        hasher=hasher,
        policy=KeyPolicy(bind_content=True),
    )
    assert keyed.multi_modal_data["image"][0] is image
    before = (_key(keyed, "image"), _key(bound, "image"))
    image.putpixel((0, 0), 0)
    after = (_key(keyed, "image"), _key(bound, "image"))
    assert after[0] == f"stage0:rep0:{hasher.content_key('image', image)}" != before[0]
    assert (
        after[1] != before[1]
        and after[1]
        == rendered_uuids(
            scope_to_replica(
                TextPrompt(
                    prompt="x", multi_modal_data={"image": image.copy()}, multi_modal_uuids={"image": "cat"}
                ),
                0,
                hasher=hasher,
                policy=KeyPolicy(bind_content=True),
            )
        )["image"][0]
    )  # type: ignore[index]


def test_a_record_of_the_same_media_changed_is_never_given_a_remembered_key(hasher: MediaHasher) -> None:
    template = TextPrompt(prompt="x", multi_modal_data={"video": video(1)})
    scoped = scope_to_replica(template, 1, hasher=hasher)
    assert _key(scoped) == f"stage0:rep1:{hasher.key('video', video(1))}"  # remembered now
    for changed in (  # each keeps the scope: rendered as it is, not scoped again
        scoped.replace_media({"video": video(2)}),
        attrs.evolve(scoped, multi_modal_data={"video": video(2)}),
        replace_fields(
            scoped,
            multi_modal_data=TextPrompt(prompt="y", multi_modal_data={"video": video(2)}).multi_modal_data,
        ),
    ):
        assert changed.scope is scoped.scope
        assert _key(changed) == f"stage0:rep1:{hasher.key('video', video(2))}"


def test_content_keys_are_derived_on_every_render_even_beside_user_uuids(hasher: MediaHasher) -> None:
    frames, still = video(1), np.zeros((2, 2, 3), np.uint8)
    scoped = scope_to_replica(
        TextPrompt(
            prompt="x",
            multi_modal_data={"image": still, "video": frames},
            multi_modal_uuids={"image": "still-1"},
        ),
        0,
        hasher=hasher,
    )
    original = frames.copy()
    before = rendered_uuids(scoped)
    frames[:] = 7  # the caller writes through its own reference: the record has its own copy
    after = rendered_uuids(scoped)
    assert before is not None and after is not None
    assert after["image"] == before["image"] == ["stage0:rep0:still-1"]
    assert after["video"] == [f"stage0:rep0:{hasher.key('video', original)}"] == before["video"]


def test_rendered_lists_are_new_each_call(hasher: MediaHasher) -> None:
    scoped = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_data={"image": [None]}, multi_modal_uuids={"image": ["c"]}),
        0,
        hasher=hasher,
    )
    first = rendered_uuids(scoped)
    assert first is not None
    first["image"].append("stage0:rep0:stale")
    first["audio"] = ["x"]
    assert rendered_uuids(scoped) == {"image": ["stage0:rep0:c"]}


def test_the_memo_is_no_part_of_a_records_value(hasher: MediaHasher) -> None:
    template = TextPrompt(prompt="x", multi_modal_data={"image": [None]}, multi_modal_uuids={"image": ["c"]})
    scoped = scope_to_replica(template, 0, hasher=hasher)
    rendered_uuids(scoped)
    fresh = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_data={"image": [None]}, multi_modal_uuids={"image": ["c"]}),
        0,
        hasher=hasher,
    )
    assert scoped == fresh and hash(scoped.multi_modal_uuids) == hash(fresh.multi_modal_uuids)
    assert "_memo" not in repr(scoped) and "_memo" not in attrs.asdict(scoped)
    assert "_memo" not in {field.name for field in attrs.fields(TextPrompt)}
    assert pickle.loads(pickle.dumps(scoped))._memo == {}


def test_modalities_keep_the_callers_order(hasher: MediaHasher) -> None:
    # Records store PMaps, whose order follows string hashes (and so PYTHONHASHSEED);
    # the engine's UUIDs follow the order the caller gave instead (media_keys is a PMap).
    names = ["video", "image", "audio", "a", "z"]
    data = {name: [None] for name in names}
    uuids = {name: [f"{name}-1"] for name in reversed(names)}
    scoped = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_data=data, multi_modal_uuids=uuids), 0, hasher=hasher
    )
    rendered = rendered_uuids(scoped)
    assert rendered is not None and list(rendered) == names


def test_every_empty_map_is_the_one_empty_map(hasher: MediaHasher) -> None:
    # scope_to_replica tells "no media" by identity with the shared empty map.
    emptied = pmap({"image": [np.zeros((2, 2, 3), np.uint8)]}).discard("image")
    assert emptied is not pmap()
    p = TextPrompt(prompt="x", multi_modal_data=emptied, multi_modal_uuids={})
    assert p.multi_modal_data is _EMPTY and p.multi_modal_uuids is _EMPTY
    assert scope_to_replica(p, 1, hasher=hasher) is p
