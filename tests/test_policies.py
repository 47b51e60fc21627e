"""User UUIDs: engine-scoped ones are refused, and KeyPolicy's opt-in protections hold."""

from __future__ import annotations

import itertools
import pickle
from uuid import UUID

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyOrigin,
    KeyPolicy,
    MediaHasher,
    MediaKey,
    PromptTypeError,
    Scope,
    TextPrompt,
    media_keys,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests_vllm import from_vllm, to_vllm

from .conftest import record_calls, video

ALL_POLICIES = [
    KeyPolicy(namespaces=n, tenant=t, tenant_content=tc, bind_content=b)
    for n, t, tc, b in itertools.product([False, True], [None, "acme"], [False, True], [False, True])
    if t is not None or not tc
]


def _image(seed: int, side: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def _keys(prompt: TextPrompt, modality: str = "image") -> list[str | None]:
    rendered = rendered_uuids(prompt)
    assert rendered is not None
    return rendered[modality]


# -- always on: UUIDs that have been through an engine are refused --


@pytest.mark.parametrize("uuid", ["stage0:rep1:cat", "stage12:rep3:stage0:rep0:abc", "stage0:rep0:"])
def test_an_engine_scoped_uuid_is_refused_with_a_rebuild_hint(uuid: str) -> None:
    with pytest.raises(InvalidPromptError) as caught:
        TextPrompt(
            prompt="x",
            multi_modal_data={"image": [_image(1), _image(2)]},
            multi_modal_uuids={"image": ["ok", uuid]},
        )
    assert caught.value.path == "$.multi_modal_uuids.image[1]"
    assert "already scoped to a replica" in caught.value.message
    assert "rebuild it from the original prompt" in caught.value.message


def test_the_adapter_and_evolve_refuse_engine_scoped_uuids_too(hasher: MediaHasher) -> None:
    used = to_vllm(
        scope_to_replica(TextPrompt(prompt="x", multi_modal_data={"video": video(1)}), 1, hasher=hasher)
    )
    with pytest.raises(InvalidPromptError, match="already scoped") as caught:
        from_vllm(used)  # the engine's dict, fed back in: the template-reuse bug
    assert caught.value.path == "$.multi_modal_uuids.video[0]"
    p = TextPrompt(prompt="x", multi_modal_data={"video": video(1)}, multi_modal_uuids={"video": "v"})
    with pytest.raises(InvalidPromptError, match="already scoped"):
        attrs.evolve(p, multi_modal_uuids={"video": "stage0:rep0:v"})


@pytest.mark.parametrize(
    "uuid", ["stage:rep1:x", "stage0-rep1-x", "xstage0:rep0:y", "stage0:replica1:x", "rep0:x"]
)
def test_uuids_that_only_resemble_a_scope_are_accepted(uuid: str, hasher: MediaHasher) -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"image": _image(1)}, multi_modal_uuids={"image": uuid})
    assert _keys(scope_to_replica(p, 0, hasher=hasher)) == [f"stage0:rep0:{uuid}"]


# -- the default policy renders exactly as vllm-omni does --


def test_the_default_policy_is_todays_rendering(hasher: MediaHasher) -> None:
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [_image(1), None, _image(2)]},
        multi_modal_uuids={"image": ["cat", "cached", None], "audio": ["a1"]},
    )
    plain = scope_to_replica(p, 1, hasher=hasher)
    explicit = scope_to_replica(p, 1, hasher=hasher, policy=KeyPolicy())
    expected = ["stage0:rep1:cat", "stage0:rep1:cached", f"stage0:rep1:{hasher.key('image', _image(2))}"]
    assert (
        rendered_uuids(plain) == rendered_uuids(explicit) == {"image": expected, "audio": ["stage0:rep1:a1"]}
    )
    assert plain.scope == explicit.scope == Scope(0, 1, hasher)
    assert scope_to_replica(plain, 1, hasher=hasher, policy=KeyPolicy()) is plain


# -- namespaces --


def test_without_namespaces_a_uuid_equal_to_a_content_hash_aliases_that_item(hasher: MediaHasher) -> None:
    a, b = _image(1), _image(2)
    forged = hasher.key("image", a)  # a client sends b under a's content hash
    p = TextPrompt(
        prompt="x", multi_modal_data={"image": [a, b]}, multi_modal_uuids={"image": [None, forged]}
    )
    # Within one prompt the alias is refused where the keys are made ...
    with pytest.raises(InvalidPromptError, match="is the content key of"):
        _keys(scope_to_replica(p, 0, hasher=hasher))
    # ... across requests it is the threat: b under a's key, served a's cached features.
    first = TextPrompt(prompt="x", multi_modal_data={"image": a})
    later = TextPrompt(prompt="x", multi_modal_data={"image": b}, multi_modal_uuids={"image": forged})
    assert _keys(scope_to_replica(first, 0, hasher=hasher)) == _keys(
        scope_to_replica(later, 0, hasher=hasher)
    )
    # namespaces=True renders a user UUID apart from every content key, across requests.
    namespaced = KeyPolicy(namespaces=True)
    assert _keys(scope_to_replica(first, 0, hasher=hasher, policy=namespaced)) == [f"stage0:rep0:{forged}"]
    assert _keys(scope_to_replica(later, 0, hasher=hasher, policy=namespaced)) == [
        f"stage0:rep0:user:{forged}"
    ]
    # Within one prompt the alias is refused whatever the policy (the bases a policy reads
    # are shared by a template's scopes).
    with pytest.raises(InvalidPromptError, match="is the content key of"):
        _keys(scope_to_replica(p, 0, hasher=hasher, policy=namespaced))


@given(uuid=st.text(min_size=1).filter(lambda u: not u.startswith(("stage", "tenant:", "user:", "bound:"))))
def test_with_namespaces_no_user_key_equals_a_content_key(uuid: str) -> None:
    hasher = MediaHasher("m")
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [_image(1), _image(2)]},
        multi_modal_uuids={"image": [uuid, None]},
    )
    user, content = _keys(scope_to_replica(p, 0, hasher=hasher, policy=KeyPolicy(namespaces=True)))
    assert user != content and user == f"stage0:rep0:user:{uuid}"


# -- tenants --


def test_the_same_uuid_from_two_tenants_gets_two_keys(hasher: MediaHasher) -> None:
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [_image(1), _image(2)]},
        multi_modal_uuids={"image": ["logo", None]},
    )
    acme = _keys(scope_to_replica(p, 0, hasher=hasher, policy=KeyPolicy(tenant="acme")))
    globex = _keys(scope_to_replica(p, 0, hasher=hasher, policy=KeyPolicy(tenant="globex")))
    assert acme[0] == "stage0:rep0:tenant:acme:logo" and globex[0] == "stage0:rep0:tenant:globex:logo"
    assert acme[1] == globex[1]  # content keys are shared by default: same bytes, same features
    isolated = [
        _keys(scope_to_replica(p, 0, hasher=hasher, policy=KeyPolicy(tenant=t, tenant_content=True)))[1]
        for t in ("acme", "globex")
    ]
    assert isolated == [
        f"stage0:rep0:tenant:{t}:{hasher.key('image', _image(2))}" for t in ("acme", "globex")
    ]


def test_a_tenant_policy_given_to_a_prompt_without_media_stays_for_media_added_later(
    hasher: MediaHasher,
) -> None:
    # A template without media came back as itself, its policy dropped: media added
    # later (replace_media) reached the engine as stage0:rep1:photo, without the tenant.
    tenant = KeyPolicy(tenant="acme")
    template = scope_to_replica(TextPrompt(prompt="<image> describe"), 0, hasher=hasher, policy=tenant)
    assert template.scope is not None and template.scope.policy == tenant
    request = template.replace_media({"image": np.zeros((4, 4, 3), np.uint8)}, {"image": "photo"})
    assert _keys(scope_to_replica(request, 1, hasher=hasher)) == ["stage0:rep1:tenant:acme:photo"]
    with pytest.raises(InvalidPromptError, match="keeps its policy"):
        scope_to_replica(template, 0, hasher=hasher, policy=KeyPolicy(tenant="other"))
    bare = TextPrompt(prompt="x")
    assert scope_to_replica(bare, 0, hasher=hasher) is bare  # no policy: nothing to keep


def test_all_parts_together_render_in_a_fixed_order(hasher: MediaHasher) -> None:
    item = _image(1)
    p = TextPrompt(prompt="x", multi_modal_data={"image": item}, multi_modal_uuids={"image": "u:1"})
    policy = KeyPolicy(namespaces=True, tenant="acme", bind_content=True)
    assert _keys(scope_to_replica(p, 2, hasher=hasher, stage_id=1, policy=policy)) == [
        f"stage1:rep2:tenant:acme:user:bound:{hasher.fingerprint('image', item)}:u:1"
    ]


@pytest.mark.parametrize(
    "policy",
    [KeyPolicy(tenant="t", namespaces=n, bind_content=b) for n in (False, True) for b in (False, True)],
)
def test_tenant_uuid_pairs_never_collide(policy: KeyPolicy, hasher: MediaHasher) -> None:
    # Colons are allowed in UUIDs and refused in tenant names, so the split is unambiguous.
    policy_kwargs = attrs.asdict(policy)
    seen: dict[str, tuple[str, str]] = {}
    for tenant, uuid in itertools.product(
        ["a", "a.b", "tenant", "b"], ["b:c", "c", "tenant", "user", "a:b:c", "tenant-a:c"]
    ):
        pol = KeyPolicy(**{**policy_kwargs, "tenant": tenant})
        p = TextPrompt(prompt="x", multi_modal_data={"image": _image(1)}, multi_modal_uuids={"image": uuid})
        key = _keys(scope_to_replica(p, 0, hasher=hasher, policy=pol))[0]
        assert key is not None
        assert seen.setdefault(key, (tenant, uuid)) == (tenant, uuid)


@pytest.mark.parametrize(
    ("kwargs", "error", "path"),
    [
        ({"tenant": "a:b"}, InvalidPromptError, "$.tenant"),
        ({"tenant": ""}, InvalidPromptError, "$.tenant"),
        ({"tenant": "x" * 129}, InvalidPromptError, "$.tenant"),
        ({"tenant": "caf\u00e9"}, InvalidPromptError, "$.tenant"),
        ({"tenant": 7}, PromptTypeError, "$.tenant"),
        ({"namespaces": 1}, PromptTypeError, "$.namespaces"),
        ({"bind_content": "yes"}, PromptTypeError, "$.bind_content"),
        ({"tenant_content": True}, InvalidPromptError, "$.tenant_content"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object], error: type[Exception], path: str) -> None:
    with pytest.raises(error) as caught:
        KeyPolicy(**kwargs)  # type: ignore[arg-type]
    assert caught.value.path == path  # type: ignore[attr-defined]


def test_policy_must_be_a_key_policy(hasher: MediaHasher) -> None:
    p = TextPrompt(prompt="x", multi_modal_data={"image": _image(1)})
    with pytest.raises(PromptTypeError) as caught:
        scope_to_replica(p, 0, hasher=hasher, policy={"namespaces": True})  # type: ignore[arg-type]
    assert caught.value.path == "policy"
    with pytest.raises(PromptTypeError, match="KeyPolicy"):
        Scope(0, 0, hasher, "strict")  # type: ignore[arg-type]


# -- content binding --


def test_a_uuid_reused_for_a_longer_clip_gets_another_key(hasher: MediaHasher) -> None:
    # vLLM's report: a 30 s clip sent under a 10 s clip's UUID was served the 10 s features.
    rng = np.random.default_rng(0)
    ten, thirty = (
        rng.standard_normal(160_000).astype(np.float32),
        rng.standard_normal(480_000).astype(np.float32),
    )
    policy = KeyPolicy(bind_content=True)

    def key(clip: np.ndarray) -> str | None:
        p = TextPrompt(prompt="x", multi_modal_data={"audio": clip}, multi_modal_uuids={"audio": "clip-7"})
        return _keys(scope_to_replica(p, 0, hasher=hasher, policy=policy), "audio")[0]

    assert key(ten) != key(thirty)
    assert key(ten) == key(ten.copy())  # the same media again: the same key, a cache hit
    unbound = TextPrompt(
        prompt="x", multi_modal_data={"audio": thirty}, multi_modal_uuids={"audio": "clip-7"}
    )
    assert _keys(scope_to_replica(unbound, 0, hasher=hasher), "audio") == ["stage0:rep0:clip-7"]


def test_binding_is_to_the_records_own_copy(hasher: MediaHasher) -> None:
    frames = video(1)
    p = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_data={"video": frames}, multi_modal_uuids={"video": "v"}),
        0,
        hasher=hasher,
        policy=KeyPolicy(bind_content=True),
    )
    before = _keys(p, "video")
    bound = f"stage0:rep0:bound:{hasher.fingerprint('video', frames.copy())}:v"
    frames[0, 0, 0, 0] ^= 0xFF  # the first byte is always sampled, but the record holds a copy
    assert _keys(p, "video") == before == [bound]


def test_a_cached_only_item_cannot_be_bound(hasher: MediaHasher) -> None:
    policy = KeyPolicy(bind_content=True)
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [None, _image(1)]},
        multi_modal_uuids={"image": ["seen", "new"]},
    )
    with pytest.raises(InvalidPromptError, match="cached only") as caught:
        scope_to_replica(p, 0, hasher=hasher, policy=policy)
    assert caught.value.path == "$.multi_modal_data.image[0]"
    only_uuids = TextPrompt(
        prompt="x", multi_modal_data={"image": _image(1)}, multi_modal_uuids={"audio": "a"}
    )
    with pytest.raises(InvalidPromptError, match="cached only") as caught:
        scope_to_replica(only_uuids, 0, hasher=hasher, policy=policy)
    assert caught.value.path == "$.multi_modal_uuids.audio[0]"  # no multi_modal_data.audio to name
    assert scope_to_replica(p, 0, hasher=hasher) is not p  # fine without binding


def test_a_bound_records_copy_cannot_make_an_item_cached_only(hasher: MediaHasher) -> None:
    # A copy keeps the scope and its policy: refused when built, not when it is rendered.
    p = TextPrompt(prompt="x", multi_modal_data={"image": _image(1)}, multi_modal_uuids={"image": "photo"})
    bound = scope_to_replica(p, 0, hasher=hasher, policy=KeyPolicy(bind_content=True))
    for copy, path in (
        (lambda: bound.replace_media({"image": [None]}, {"image": ["photo"]}), "$.multi_modal_data.image[0]"),
        (
            lambda: attrs.evolve(bound, multi_modal_uuids={"image": ["photo"], "audio": ["a"]}),
            "$.multi_modal_uuids.audio[0]",  # UUIDs alone: no data field to name
        ),
    ):
        with pytest.raises(InvalidPromptError, match="cached only") as caught:
            copy()
        assert caught.value.path == path
    unbound = scope_to_replica(p, 0, hasher=hasher)
    assert unbound.replace_media({"image": [None]}, {"image": ["photo"]}).multi_modal_data["image"][0] is None


def test_media_keys_carry_the_binding(hasher: MediaHasher) -> None:
    item = _image(3)
    p = TextPrompt(
        prompt="x", multi_modal_data={"image": [item, _image(4)]}, multi_modal_uuids={"image": ["u", None]}
    )
    user, content = media_keys(scope_to_replica(p, 0, hasher=hasher, policy=KeyPolicy(bind_content=True)))[
        "image"
    ]
    assert (
        user is not None
        and user.binding == hasher.fingerprint("image", item)
        and user.origin is KeyOrigin.USER
    )
    assert content is not None and content.binding is None
    unbound = MediaKey("u", KeyOrigin.USER, Scope(0, 0, hasher, KeyPolicy(bind_content=True)))
    with pytest.raises(InvalidPromptError, match="no fingerprint"):
        unbound.render()


# -- fingerprints --


def test_fingerprints_see_type_dtype_shape_length_and_sampled_bytes(hasher: MediaHasher) -> None:
    big = np.random.default_rng(5).integers(0, 256, (64, 128, 128, 3), dtype=np.uint8)  # 3 MB: sampled
    fp = hasher.fingerprint("video", big)
    assert len(fp) == 32 and fp == hasher.fingerprint("video", big.copy())
    others = [
        big.astype(np.int16),
        big.reshape(128, 64, 128, 3),
        big[:-1],
        np.concatenate([big, big[:1]]),
        [big],
        (big, 30),
    ]
    assert len({fp, *(hasher.fingerprint("video", o) for o in others)}) == len(others) + 1
    assert hasher.fingerprint("image", big) != fp  # the modality counts too
    changed = big.copy()
    changed.reshape(-1)[-1] ^= 1  # the last byte is always sampled
    assert hasher.fingerprint("video", changed) != fp


def test_a_change_between_samples_keeps_the_fingerprint(hasher: MediaHasher) -> None:
    # The documented limit: binding catches reuse for other media, not a crafted edit.
    big = np.zeros(1 << 20, np.uint8)
    edited = big.copy()
    edited[5000] = 1  # between the first two 4 KiB samples of 1 MiB
    assert hasher.fingerprint("audio", edited) == hasher.fingerprint("audio", big)
    assert hasher.key("audio", edited) != hasher.key("audio", big)


def test_small_items_are_fingerprinted_whole(hasher: MediaHasher) -> None:
    small = np.zeros(60_000, np.uint8)
    edited = small.copy()
    edited[30_000] = 1
    assert hasher.fingerprint("audio", edited) != hasher.fingerprint("audio", small)


def test_non_contiguous_arrays_fingerprint_like_their_contiguous_copy(hasher: MediaHasher) -> None:
    base = np.random.default_rng(6).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    for view in (base[:, ::2], base.transpose(1, 0, 2), base[::-1]):
        assert not view.flags.c_contiguous
        assert hasher.fingerprint("image", view) == hasher.fingerprint("image", np.ascontiguousarray(view))


def test_image_fingerprints_see_mode_size_palette_and_sampled_rows(hasher: MediaHasher) -> None:
    pixels = np.random.default_rng(7).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    fp = hasher.fingerprint("image", image)
    assert fp == hasher.fingerprint("image", Image.fromarray(pixels.copy()))
    edited = pixels.copy()
    edited[0, 10] ^= 0xFF  # row 0 is always sampled
    variants = [Image.fromarray(edited), image.convert("L"), image.resize((641, 480)), image.convert("P")]
    assert len({fp, *(hasher.fingerprint("image", v) for v in variants)}) == len(variants) + 1


def test_images_sharing_an_exif_image_id_are_bound_apart(hasher: MediaHasher) -> None:
    # vLLM's parser drops an in-memory ImageID, so these are three inputs to the model.
    # A fingerprint that read the ID alone gave them one bound key, and the engine served
    # the first image's features for the others under the user's UUID.
    shared_id = UUID("01234567-89ab-cdef-0123-456789abcdef")
    pixels = np.random.default_rng(8).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    images = [
        Image.fromarray(pixels),
        Image.fromarray(pixels).convert("L"),
        Image.fromarray(pixels[::-1].copy()),
    ]
    turned = Image.fromarray(pixels)
    turned.getexif()[0x0112] = 6  # the parser turns this one a quarter
    for image in [*images, turned]:
        image.getexif()[0x800D] = shared_id  # EXIF ImageID
    images.append(turned)
    assert len({hasher.fingerprint("image", image) for image in images}) == len(images)
    policy = KeyPolicy(bind_content=True)
    bound = {
        _keys(
            scope_to_replica(
                TextPrompt(
                    prompt="x", multi_modal_data={"image": image}, multi_modal_uuids={"image": "photo"}
                ),
                0,
                hasher=hasher,
                policy=policy,
            )
        )[0]
        for image in images
    }
    assert len(bound) == len(images)


def test_tensor_fingerprints_cover_bfloat16_without_copying(hasher: MediaHasher) -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(100_000, dtype=torch.float32).reshape(100, 1000)
    fps = {hasher.fingerprint("image", x) for x in (t, t.to(torch.bfloat16), t.to(torch.float16), t.T)}
    assert len(fps) == 4
    assert hasher.fingerprint("image", t.T) == hasher.fingerprint("image", t.T.contiguous())


def test_fingerprints_of_frozen_items_are_computed_once(
    hasher: MediaHasher, monkeypatch: pytest.MonkeyPatch
) -> None:
    item = TextPrompt(prompt="x", multi_modal_data={"image": _image(9, side=64)}).multi_modal_data["image"][0]
    calls = record_calls(monkeypatch, MediaHasher, "_fingerprint", 2)
    first = hasher.fingerprint("image", item)
    assert [hasher.fingerprint("image", item) for _ in range(3)] == [first] * 3
    assert len(calls) == 1


# -- every policy: the fast rendering equals MediaKey.render(), and policies travel --


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=repr)
def test_rendered_uuids_equal_each_keys_render(policy: KeyPolicy, hasher: MediaHasher) -> None:
    p = TextPrompt(
        prompt="x",
        multi_modal_data={"image": [_image(1), _image(2)], "video": video(3)},
        multi_modal_uuids={"image": ["cat", None]},
    )
    scoped = scope_to_replica(p, 3, hasher=hasher, stage_id=1, policy=policy)
    keys = media_keys(scoped)
    assert rendered_uuids(scoped) == {m: [k.render() if k else None for k in row] for m, row in keys.items()}
    assert to_vllm(scoped)["multi_modal_uuids"] == rendered_uuids(scoped)
    restored = pickle.loads(pickle.dumps(scoped))
    assert restored.scope == scoped.scope and rendered_uuids(restored) == rendered_uuids(scoped)


def test_changing_only_the_policy_rescopes(hasher: MediaHasher) -> None:
    p = scope_to_replica(
        TextPrompt(prompt="x", multi_modal_data={"image": _image(1)}, multi_modal_uuids={"image": "u"}),
        0,
        hasher=hasher,
    )
    q = scope_to_replica(p, 0, hasher=hasher, policy=KeyPolicy(namespaces=True))
    assert q is not p and _keys(q) == ["stage0:rep0:user:u"] and _keys(p) == ["stage0:rep0:u"]
    assert scope_to_replica(q, 0, hasher=hasher, policy=KeyPolicy(namespaces=True)) is q


def test_encoder_decoder_prompts_take_the_policy_into_both_parts(hasher: MediaHasher) -> None:
    part = TextPrompt(prompt="x", multi_modal_data={"image": _image(1)}, multi_modal_uuids={"image": "u"})
    q = scope_to_replica(
        EncoderDecoderPrompt(encoder_prompt=part, decoder_prompt=part),
        1,
        hasher=hasher,
        policy=KeyPolicy(tenant="t"),
    )
    assert q.decoder_prompt is not None
    assert _keys(q.encoder_prompt) == _keys(q.decoder_prompt) == ["stage0:rep1:tenant:t:u"]


def test_policies_and_scopes_pickle_through_their_constructors(hasher: MediaHasher) -> None:
    policy = KeyPolicy(namespaces=True, tenant="acme", tenant_content=True, bind_content=True)
    scope = Scope(2, 5, hasher, policy)
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert pickle.loads(pickle.dumps(scope)) == scope
    assert policy.__reduce__() == (KeyPolicy, (True, "acme", True, True))
