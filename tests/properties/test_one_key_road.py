"""Every road to a key gives the same key.

Keys are made in one place (``_keys.KeyText``, walked by ``_scoping._derive``), and read
through several roads: ``media_keys`` then ``MediaKey.render``, ``rendered_uuids`` (first
call and memoized), ``to_vllm``, a ``KeyPolicy.render_base`` under the scope's prefix,
and the dict road an engine takes (``from_vllm``, scope, ``to_vllm``). Over the library's
own strategies, under every policy, they agree item for item.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from omni_requests import (
    InvalidPromptError,
    KeyOrigin,
    KeyPolicy,
    MediaHasher,
    SinglePrompt,
    media_keys,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests import strategies as S
from omni_requests_vllm import from_vllm, to_vllm

PROPERTY = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
POLICIES = st.builds(
    KeyPolicy,
    namespaces=st.booleans(),
    tenant=st.none() | st.sampled_from(("acme", "t-1")),
    bind_content=st.booleans(),
).flatmap(
    lambda p: (
        st.just(p)
        if p.tenant is None
        else st.sampled_from((p, KeyPolicy(namespaces=p.namespaces, tenant=p.tenant, tenant_content=True)))
    )
)
Keys = dict[str, list[str | None]]


def _scoped(prompt: SinglePrompt, replica: int, stage: int, hasher: MediaHasher, policy: KeyPolicy) -> Any:
    try:
        return scope_to_replica(prompt, replica, hasher=hasher, stage_id=stage, policy=policy)
    except InvalidPromptError as error:  # binding needs every UUID's item sent
        assume("binds UUID" not in error.message)
        raise


def _by_media_keys(prompt: SinglePrompt) -> Keys:
    return {m: [None if k is None else k.render() for k in row] for m, row in media_keys(prompt).items()}


def _by_policy(prompt: SinglePrompt, hasher: MediaHasher, prefix: str, policy: KeyPolicy) -> Keys:
    """From the unscoped bases: the scope's prefix, then the policy's part."""
    out: Keys = {}
    data = prompt.multi_modal_data
    for modality, row in media_keys(prompt, hasher).items():
        keys: list[str | None] = []
        for i, key in enumerate(row):
            if key is None:
                keys.append(None)
                continue
            binding = None
            if key.origin is KeyOrigin.USER and policy.bind_content:
                binding = hasher.fingerprint(modality, data[modality][i])
            keys.append(prefix + policy.render_base(key.base, key.origin, binding))
        out[modality] = keys
    return out


@PROPERTY
@given(
    prompt=S.prompts(kinds=("text", "tokens")),
    hasher=S.hashers(algorithms=("blake3", "sha256")),
    layout=S.replica_layouts(min_choices=1, max_choices=1),
    policy=POLICIES,
)
def test_every_road_gives_the_same_keys(
    prompt: SinglePrompt, hasher: MediaHasher, layout: S.ReplicaLayout, policy: KeyPolicy
) -> None:
    replica = layout.choices[0]
    scoped = _scoped(prompt, replica, layout.stage_id, hasher, policy)
    expected = _by_media_keys(scoped)
    assert (rendered_uuids(scoped) or {}) == expected
    assert (rendered_uuids(scoped) or {}) == expected  # again: from the memo where kept
    assert to_vllm(scoped).get("multi_modal_uuids", {}) == expected
    prefix = f"stage{layout.stage_id}:rep{replica}:"
    assert _by_policy(prompt, hasher, prefix, policy) == expected
    # The engine's road: a plain dict in, scoped, a plain dict out.
    engine = to_vllm(_scoped(from_vllm(to_vllm(prompt)), replica, layout.stage_id, hasher, policy))
    assert engine.get("multi_modal_uuids", {}) == expected


@pytest.mark.parametrize(
    "policy", [KeyPolicy(), KeyPolicy(namespaces=True, tenant="acme", bind_content=True)]
)
def test_the_roads_are_compared_for_real(policy: KeyPolicy) -> None:
    """One concrete record: the property's roads do render scoped keys (not all empty)."""
    import numpy as np

    from omni_requests import TextPrompt

    hasher = MediaHasher("m")
    image = np.zeros((2, 2, 3), np.uint8)
    prompt = TextPrompt(
        prompt="<image><image>",
        multi_modal_data={"image": [image, image + 1]},
        multi_modal_uuids={"image": ["a", None]},
    )
    scoped = scope_to_replica(prompt, 1, hasher=hasher, policy=policy)
    keys = _by_media_keys(scoped)["image"]
    assert keys[0] is not None and keys[0].startswith("stage0:rep1:") and keys[0].endswith(":a")
    assert keys[1] is not None and keys[1].endswith(hasher.content_key("image", image + 1))
    assert rendered_uuids(scoped) == {"image": keys} == _by_policy(prompt, hasher, "stage0:rep1:", policy)


@PROPERTY
@given(prompt=S.prompts())
def test_an_unscoped_record_reads_back_from_its_engine_dict(prompt: Any) -> None:
    # docs/design.md: from_vllm(to_vllm(record)) gives back the same dict for every
    # unscoped record, and an equal record unless the dict cannot tell the kind (a tokens
    # or text prompt carrying prompt_embeds reads back as an embeds prompt, by vLLM's rule).
    from omni_requests import EmbedsPrompt, EncoderDecoderPrompt

    from ..wire._plain import plain

    sent = to_vllm(prompt)
    back = from_vllm(sent)
    assert plain(to_vllm(back)) == plain(sent)
    parts = (
        [prompt.encoder_prompt, prompt.decoder_prompt]
        if isinstance(prompt, EncoderDecoderPrompt)
        else [prompt]
    )
    if not any(
        getattr(p, "prompt_embeds", None) is not None and not isinstance(p, EmbedsPrompt) for p in parts
    ):
        assert back == prompt
