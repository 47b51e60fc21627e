"""Fuzzing omni_requests.wire.decode with atheris (coverage-guided): ``python -m tests.reliability.wire_fuzz``.

    pip install 'omni-requests[fuzz]'
    python -m tests.reliability.wire_fuzz -atheris_runs=100000 [SEED_DIR]

The contract of test_wire_fuzz.py: for any bytes, decode returns a record that encodes
and decodes back to an equal record, or raises one of our errors; nothing else. Half the
inputs are taken as a message body behind a valid header, so the fuzzer explores the
body's parser and the records' checks, not only the header. ``SEED_DIR`` holds valid
messages to start from (test_wire_fuzz.py writes some). Importing this module needs no
atheris; running it does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HEADER = b"\x93\xadomni-requests\x01"  # msgpack: [ "omni-requests", 1, <body> ]


def check(data: bytes) -> None:
    """decode(data) is a record that round-trips, or an OmniRequestsError."""
    from omni_requests import OmniRequestsError
    from omni_requests.wire import decode, encode

    try:
        record: Any = decode(data)
    except OmniRequestsError:
        return
    again = decode(encode(record))
    assert again == record, f"{data!r} decoded to a record that does not round-trip"


def one_input(data: bytes) -> None:
    if data[:1] and data[0] & 1:
        check(HEADER + data[1:])
    else:
        check(data[1:])


def write_seeds(directory: Path) -> None:
    """Valid messages, one a file, for the fuzzer to start from."""
    import numpy as np

    from omni_requests import KeyPolicy, MediaHasher, TextPrompt, TokensPrompt, scope_to_replica
    from omni_requests.wire import encode

    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    records: list[Any] = [
        TextPrompt(prompt="x"),
        TextPrompt(
            prompt="<image>",
            multi_modal_data={"image": [image, None], "audio": (np.zeros(3, ">f4"), 16000)},
            multi_modal_uuids={"image": [None, "u"]},
            mm_processor_kwargs={"a": [1, (2.5, b"x")], "big": 2**70, "s": np.int16(3)},
        ),
        TokensPrompt(prompt_token_ids=[1, 2], multi_modal_data={"video": [image[None]]}),
    ]
    policy = KeyPolicy(namespaces=True, tenant="t")
    records.append(scope_to_replica(records[1], 1, hasher=MediaHasher("m"), stage_id=2, policy=policy))
    directory.mkdir(parents=True, exist_ok=True)
    for i, record in enumerate(records):
        message = encode(record)
        (directory / f"seed{i}").write_bytes(b"\x00" + message)
        (directory / f"body{i}").write_bytes(b"\x01" + message[len(HEADER) :])


def main() -> None:
    import atheris

    with atheris.instrument_imports():
        import msgspec  # noqa: F401

        import omni_requests
        import omni_requests.wire  # noqa: F401
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
