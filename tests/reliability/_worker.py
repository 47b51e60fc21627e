"""One process of tests/reliability/test_processes.py: ``python -m tests.reliability._worker``.

``write DIR``: print this process's keys as JSON and write its records to DIR (pickle, and
the wire format of ``omni_requests.wire``). ``read DIR``: load another process's files,
check they equal this process's own records (with the same keys and modality order), and
print the keys of what was loaded. The corpus is built deterministically,
so every process builds equal records.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from PIL import Image
from pyrsistent import pvector

from omni_requests import (
    EncoderDecoderPrompt,
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    TextPrompt,
    TokensPrompt,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests.wire import decode, encode
from omni_requests_vllm import to_vllm

HASHER = MediaHasher("/models/processes")
POLICIES = [
    None,
    KeyPolicy(namespaces=True, tenant="acme", tenant_content=True),
    KeyPolicy(namespaces=True, bind_content=True),
]


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def plain_records() -> list[Any]:
    """Records whose engine dicts hold only lists, dicts, tuples, arrays and scalars."""
    video = _rng(1).integers(0, 256, (3, 6, 5, 3), dtype=np.uint8)
    return [
        TextPrompt(
            prompt="<video><image>",
            multi_modal_data={
                "video": video,
                "image": [_rng(2).integers(0, 256, (4, 4, 3), dtype=np.uint8), video[0, ::2]],
            },
            multi_modal_uuids={"image": ["cat", None]},
            mm_processor_kwargs={"fps": 2, "sizes": [1, 2], "nested": {"b": 1, "a": (1, 2.5)}},
            cache_salt="salt",
        ),
        TokensPrompt(
            prompt_token_ids=[1, 2, 3],
            multi_modal_data={
                "audio": [(_rng(3).standard_normal(50).astype(np.float32), 16000), _rng(4).random(7)],
                "video": [[_rng(5).integers(0, 256, (4, 4, 3), dtype=np.uint8)] * 2],
            },
            multi_modal_uuids={"audio": [None, "clip"], "image": ["cached-only"]},
        ),
        TextPrompt(
            prompt="<image>", multi_modal_data={"image": _rng(6).random((3, 3, 3)).astype(np.float16)}
        ),
    ]


def records() -> list[Any]:
    """Everything: the plain records, PIL images, tensors, an encoder-decoder pair."""
    pixels = _rng(7).integers(0, 256, (9, 11, 3), dtype=np.uint8)
    extra: list[Any] = [
        TextPrompt(
            prompt="<image><image>",
            multi_modal_data={"image": [Image.fromarray(pixels), Image.fromarray(pixels).convert("L")]},
        ),
        EncoderDecoderPrompt(
            encoder_prompt=TextPrompt(
                prompt="e", multi_modal_data={"audio": (np.zeros(8, np.float32), 8000)}
            ),
            decoder_prompt=TextPrompt(prompt="d"),
        ),
    ]
    if importlib.util.find_spec("torch") is not None:
        import torch

        t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
        extra.append(
            TextPrompt(prompt="<image>", multi_modal_data={"image": [t[0], t[1].to(torch.bfloat16)]})
        )
    return plain_records() + extra


def scoped(record: Any) -> list[Any]:
    out = []
    for replica, stage in ((0, 0), (3, 1)):
        for policy in POLICIES:
            try:
                out.append(scope_to_replica(record, replica, hasher=HASHER, stage_id=stage, policy=policy))
            except InvalidPromptError:  # binding refuses cached-only items
                assert policy is not None and policy.bind_content
    return out


def keys(record: Any) -> list[Any]:
    out = []
    for s in scoped(record):
        parts = [s.encoder_prompt, s.decoder_prompt] if isinstance(s, EncoderDecoderPrompt) else [s]
        out.append([None if p is None else rendered_uuids(p) for p in parts])
    return out


def main(mode: str, directory: Path) -> None:
    c_extension = type(pvector()).__module__ == "pvectorc"
    assert c_extension == (not os.environ.get("PYRSISTENT_NO_C_EXTENSION")), "the env var did not take"
    mine = records()
    if mode == "write":
        (directory / "records.pickle").write_bytes(pickle.dumps([scoped(r) for r in mine]))
        messages = [encode(s) for r in mine for s in [r, *scoped(r)]]
        (directory / "records.wire").write_bytes(msgspec.msgpack.encode(messages))
        loaded = mine
    else:
        groups = pickle.loads((directory / "records.pickle").read_bytes())
        assert groups == [scoped(r) for r in mine], "unpickled records differ from this process's"
        loaded = [_unscope(group[0]) for group in groups]
        messages = msgspec.msgpack.decode((directory / "records.wire").read_bytes())
        expected = [s for r in mine for s in [r, *scoped(r)]]
        decoded = [decode(m) for m in messages]
        assert decoded == expected, "the wire format changed a record"
        assert _engine_view(decoded) == _engine_view(expected), "the wire format changed a key or the order"
    print(
        json.dumps(
            {
                "c_extension": c_extension,
                "hash_seed": os.environ.get("PYTHONHASHSEED"),
                "keys": [keys(r) for r in loaded],
                "fingerprints": [HASHER.fingerprint("image", x) for x in _fingerprinted()],
            }
        )
    )


def _engine_view(records: list[Any]) -> list[Any]:
    """Each single record's engine keys and modality order (an encoder-decoder pair: its encoder's)."""
    out = []
    for record in records:
        sent = to_vllm(record.encoder_prompt if isinstance(record, EncoderDecoderPrompt) else record)
        out.append((sent.get("multi_modal_uuids"), list(sent.get("multi_modal_data", {}))))
    return out


def _unscope(record: Any) -> Any:
    import attrs

    if isinstance(record, EncoderDecoderPrompt):
        decoder = record.decoder_prompt
        return EncoderDecoderPrompt(
            encoder_prompt=_unscope(record.encoder_prompt), decoder_prompt=decoder and _unscope(decoder)
        )
    return attrs.evolve(record, scope=None)


def _fingerprinted() -> list[Any]:
    big = _rng(8).integers(0, 256, (200, 300, 3), dtype=np.uint8)  # sampled, not read whole
    return [big, big[:, ::2], Image.fromarray(big), [big, (big[0], 3)]]


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
