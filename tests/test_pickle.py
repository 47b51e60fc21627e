"""Records pickle through their constructor: values come back checked and frozen."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from omni_requests import (
    EncoderDecoderPrompt,
    MediaHasher,
    TextPrompt,
    TokensPrompt,
    rendered_uuids,
    scope_to_replica,
)

from .conftest import video


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_round_trip_keeps_values_scope_and_keys(hasher: MediaHasher, protocol: int) -> None:
    p = scope_to_replica(
        TextPrompt(
            prompt="x",
            multi_modal_data={
                "video": [video(1), [video(2)[0]] * 2],
                "audio": (np.zeros(4, np.float32), 8000),
            },
            multi_modal_uuids={"audio": "a"},
            mm_processor_kwargs={"fps": 2},
        ),
        1,
        hasher=hasher,
    )
    q = pickle.loads(pickle.dumps(p, protocol))
    assert q == p
    assert q.scope == p.scope
    assert rendered_uuids(q) == rendered_uuids(p)
    assert not q.multi_modal_data["video"][0].flags.writeable


def test_pickle_holds_no_pyrsistent_objects() -> None:
    p = TokensPrompt(prompt_token_ids=[1, 2], multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)})
    assert b"pyrsistent" not in pickle.dumps(p) and b"pvectorc" not in pickle.dumps(p)


def test_encoder_decoder_round_trip() -> None:
    p = EncoderDecoderPrompt(encoder_prompt=TextPrompt(prompt="a"), decoder_prompt=TextPrompt(prompt="b"))
    assert pickle.loads(pickle.dumps(p)) == p


def test_object_arrays_in_options_pickle_by_value() -> None:
    p = TextPrompt(prompt="x", additional_information={"names": np.array(["a", None], dtype=object)})
    q = pickle.loads(pickle.dumps(p))
    assert list(q.additional_information["names"]) == ["a", None]  # type: ignore[index]
