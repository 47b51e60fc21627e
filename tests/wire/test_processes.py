"""Records decoded in another process equal the records sent: same engine dict, same keys, same order.

The corpus is the library's own strategies: every record kind, every media kind
(images of every mode, with palettes and EXIF ImageIDs; arrays in every layout and byte
order; frame lists, ``(frames, metadata)`` videos, ``(waveform, rate)`` audio; tensors,
bfloat16 included, where torch is installed), user UUIDs and cached-only items, scoped
and unscoped, under every key policy. The peer process (``_peer.py``, another hash seed)
decodes each message and sends back its picture of the record and the record encoded
again; that comes back here and must decode to the very record we sent.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_requests import EncoderDecoderPrompt, InvalidPromptError, KeyPolicy, MediaHasher, scope_to_replica
from omni_requests.strategies import PROMPT_KINDS, hashers, prompts
from omni_requests.wire import decode, encode

from ._plain import picture
from .conftest import Peer

TORCH = importlib.util.find_spec("torch") is not None
KINDS = PROMPT_KINDS if TORCH else ("text", "tokens", "encoder_decoder")

POLICIES = st.sampled_from(
    [
        None,
        KeyPolicy(),
        KeyPolicy(namespaces=True),
        KeyPolicy(tenant="acme"),
        KeyPolicy(namespaces=True, tenant="acme", tenant_content=True),
        KeyPolicy(bind_content=True),
        KeyPolicy(namespaces=True, tenant="t-2", bind_content=True),
    ]
)


@st.composite
def records(draw: st.DrawFn) -> Any:
    record = draw(prompts(kinds=KINDS, embeddings=TORCH))
    if draw(st.booleans()):
        replica, stage = draw(st.integers(0, 5)), draw(st.integers(0, 3))
        hasher, policy = draw(hashers()), draw(POLICIES)
        # Binding refuses cached-only items: such a record goes unscoped.
        with contextlib.suppress(InvalidPromptError):
            record = scope_to_replica(record, replica, hasher=hasher, stage_id=stage, policy=policy)
    return record


def _check(peer: Peer, record: Any) -> None:
    message = encode(record)
    answer = peer.ask(message)
    assert "error" not in answer, answer
    assert answer["picture"] == picture(record)
    again = decode(answer["again"])
    assert again == record
    assert type(again) is type(record)
    assert picture(again) == picture(record)
    assert answer["again"] == message  # the format is deterministic: the peer wrote the same bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_records_cross_a_process_boundary_unchanged(peer: Peer, record: Any) -> None:
    _check(peer, record)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts(kinds=("encoder_decoder",)), st.integers(0, 3))
def test_encoder_decoder_records_keep_both_halves_and_their_scope(
    peer: Peer, record: Any, replica: int
) -> None:
    assert isinstance(record, EncoderDecoderPrompt)
    _check(peer, scope_to_replica(record, replica, hasher=MediaHasher("m", "sha256"), stage_id=1))
