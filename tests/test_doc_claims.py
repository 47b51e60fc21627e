"""Promises the README and docs make that no other test proved; each test names its page."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from PIL import Image

from omni_requests import (
    InvalidPromptError,
    KeyPolicy,
    MediaHasher,
    OmniRequestsError,
    PromptTypeError,
    TextPrompt,
    TokensPrompt,
    rendered_uuids,
)
from omni_requests._cli import main

ROOT = Path(__file__).parents[1]


def _block(page: str, language: str, after: str) -> str:
    """The first ``language`` code block of ``page`` that follows the text ``after``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    found = re.search(rf"{re.escape(after)}.*?```{language}\n(.*?)```", text, flags=re.DOTALL)
    assert found is not None, f"{page} has no {language} block after {after!r}"
    return found.group(1)


# -- README.md --


def test_readme_demo_output_is_what_make_demo_prints(capsys: pytest.CaptureFixture[str]) -> None:
    # README: "What `make demo` shows (abridged)"; every line it shows is printed as shown.
    shown = [line.rstrip() for line in _block("README.md", "text", "What `make demo` shows").splitlines()]
    assert main(["demo"]) == 0
    printed = {line.rstrip() for line in capsys.readouterr().out.splitlines()}
    assert [line for line in shown if line and line not in printed] == []


def test_the_core_and_adapters_import_neither_engines_nor_torch_nor_pillow() -> None:
    # README: "The core never imports vLLM or torch"; design: "imports neither torch nor
    # Pillow"; layout: both adapters are "importable without" vLLM and vllm-omni.
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from omni_requests import MediaHasher, TextPrompt, media_keys, scope_to_replica
        from omni_requests_vllm import from_vllm, to_vllm
        import omni_requests_omni

        clip = np.zeros((2, 4, 4, 3), np.uint8)
        record = scope_to_replica(
            TextPrompt(prompt="x", multi_modal_data={"video": clip}), 1, hasher=MediaHasher("m")
        )
        assert to_vllm(record)["multi_modal_uuids"]["video"][0].startswith("stage0:rep1:")
        media_keys(from_vllm({"prompt": "x", "multi_modal_data": {"image": clip[0]}}), MediaHasher("m"))
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "PIL", "vllm", "vllm_omni"))
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- docs/guide.md --


def test_the_guides_split_table_rows_for_images_pil_and_tensors() -> None:
    # guide.md, "Each modality's value is split into items the way vLLM's parser does it".
    torch = pytest.importorskip("torch")
    picture = Image.new("RGB", (2, 2))

    def count(modality: str, value: Any) -> int:
        return len(TextPrompt(prompt="x", multi_modal_data={modality: value}).multi_modal_data[modality])

    assert count("image", picture) == 1
    assert count("video", [picture, picture, picture]) == 1  # a list of PIL frames is one video
    for modality in ("image", "video", "audio"):  # a 3-D tensor: one embedding item per row
        assert count(modality, torch.zeros((3, 4, 8))) == 3


def test_evolve_keeps_uuids_for_media_equal_to_the_old() -> None:
    # guide.md: "media equal to the old (the same file loaded again) is accepted"; the
    # check compares "by identity first, then by" content key.
    def branded(video: np.ndarray) -> dict[str, Any]:
        return {"image": np.zeros((8, 8, 3), np.uint8), "video": video}

    template = TextPrompt(
        prompt="<image> <video>",
        multi_modal_data=branded(np.zeros((4, 8, 8, 3), np.uint8)),
        multi_modal_uuids={"image": "logo", "video": "clip-1"},
    )
    again = attrs.evolve(template, multi_modal_data=branded(np.zeros((4, 8, 8, 3), np.uint8)))
    assert again.multi_modal_uuids == template.multi_modal_uuids
    with pytest.raises(InvalidPromptError, match="'clip-1'"):
        attrs.evolve(template, multi_modal_data=branded(np.ones((4, 8, 8, 3), np.uint8)))


@pytest.mark.parametrize(
    ("build", "family"),
    [
        (lambda: TextPrompt(prompt="x", multi_modal_uuids={"image": ""}), ValueError),
        (lambda: TextPrompt(prompt=3), TypeError),  # type: ignore[arg-type]
    ],
)
def test_errors_are_our_family_with_a_path_and_a_message(build: Any, family: type[Exception]) -> None:
    # guide.md: "both `OmniRequestsError`s with a `path` and a `message`".
    with pytest.raises(OmniRequestsError) as caught:
        build()
    assert isinstance(caught.value, family)
    assert caught.value.path.startswith("$.") and caught.value.message
    assert str(caught.value).startswith(caught.value.path)


def test_bytes_pass_as_token_ids_to_mypy_but_the_constructor_refuses_them() -> None:
    # guide.md, "What mypy cannot see": "`bytes` passes as token ids ...; the constructor refuses it".
    with pytest.raises(PromptTypeError) as caught:
        TokensPrompt(prompt_token_ids=b"\x01\x02")
    assert caught.value.path == "$.prompt_token_ids"


# -- docs/security.md --


class _Crafted:
    """Pickles as a record whose fields someone edited in the pickle."""

    def __init__(self, record: TextPrompt, **fields: object) -> None:
        rebuild, (kind, plain) = record.__reduce__()
        self._reduced = (rebuild, (kind, {**plain, **fields}))

    def __reduce__(self) -> Any:
        return self._reduced


@pytest.mark.parametrize("uuid_", ["stage0:rep1:cat", "tenant:acme:user:cat"])
def test_unpickling_refuses_engine_scoped_and_policy_shaped_uuids(uuid_: str) -> None:
    # security.md: refused "wherever a record is built (the constructors, `attrs.evolve`,
    # `from_vllm`, unpickling)".
    record = TextPrompt(
        prompt="x",
        multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
        multi_modal_uuids={"image": "cat"},
    )
    assert pickle.loads(pickle.dumps(_Crafted(record))) == record
    data = pickle.dumps(_Crafted(record, multi_modal_uuids={"image": [uuid_]}))
    with pytest.raises(InvalidPromptError) as caught:
        pickle.loads(data)
    assert caught.value.path == "$.multi_modal_uuids.image[0]"


def test_the_security_pages_policy_example_runs_and_renders_its_policy() -> None:
    code = _block("docs/security.md", "python", "## Opt-in: `KeyPolicy`")
    prompt = TextPrompt(
        prompt="<image>",
        multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
        multi_modal_uuids={"image": "cat"},
    )
    hasher = MediaHasher("m")
    namespace: dict[str, Any] = {"prompt": prompt, "replica": 1, "hasher": hasher}
    exec(compile(code, "docs/security.md", "exec"), namespace)
    fingerprint = hasher.fingerprint("image", prompt.multi_modal_data["image"][0])
    assert re.fullmatch("[0-9a-f]{32}", fingerprint)  # "a fingerprint is always 32 hex digits"
    assert rendered_uuids(namespace["scoped"]) == {
        "image": [f"stage0:rep1:tenant:acme:user:bound:{fingerprint}:cat"]
    }
    assert namespace["scoped"].scope.policy == KeyPolicy(namespaces=True, tenant="acme", bind_content=True)


# -- docs/design.md, "Equality and hashing" --


def test_records_compare_arrays_by_bytes_and_images_by_exif_image_id() -> None:
    def audio(*values: float) -> TextPrompt:
        return TextPrompt(prompt="x", multi_modal_data={"audio": np.array(values, np.float32)})

    assert audio(np.nan, 0.0) == audio(np.nan, 0.0)  # a NaN equals itself
    assert audio(np.nan, 0.0) != audio(np.nan, -0.0)  # -0.0 differs from 0.0

    def picture(image_id: uuid.UUID) -> TextPrompt:
        image = Image.new("RGB", (2, 2))
        image.getexif()[0x800D] = image_id  # EXIF ImageID, which vLLM keys an image by
        return TextPrompt(prompt="x", multi_modal_data={"image": image})

    one, other = uuid.UUID(int=1), uuid.UUID(int=2)
    assert picture(one) == picture(one)
    assert picture(one) != picture(other)


# -- docs/wire.md --


@pytest.mark.parametrize(
    "array",
    [np.array([(1, 2.0)], dtype=[("a", "<i2"), ("b", "<f8")]), np.array(["a", None], dtype=object)],
    ids=["structured", "object"],
)
def test_arrays_with_no_wire_form_are_refused_at_encode_by_path(array: np.ndarray[Any, Any]) -> None:
    # wire.md: "a structured or object array raise `PromptTypeError` at `encode`, naming the field path".
    wire = pytest.importorskip("omni_requests.wire")
    with pytest.raises(PromptTypeError) as caught:
        wire.encode(TextPrompt(prompt="x", additional_information={"table": array}))
    assert caught.value.path == "$.additional_information.table"


def test_decode_refuses_values_nested_deeper_than_32_by_default() -> None:
    # wire.md: "values nested deeper than `max_depth` (default 32)" are refused.
    wire = pytest.importorskip("omni_requests.wire")
    msgspec = pytest.importorskip("msgspec")

    def message(depth: int) -> bytes:
        tree = msgspec.msgpack.decode(wire.encode(TextPrompt(prompt="x", mm_processor_kwargs={"d": 0})))
        nested: Any = 0
        for _ in range(depth):
            nested = [nested]
        tree[2][2]["mm_processor_kwargs"] = {"d": nested}
        return bytes(msgspec.msgpack.encode(tree))

    assert wire.decode(message(30)).mm_processor_kwargs is not None
    with pytest.raises(wire.WireError, match="max_depth=32"):
        wire.decode(message(40))


def test_decoding_memory_is_about_the_size_of_media_and_a_few_hundred_times_for_small_values() -> None:
    # wire.md: "media buffers take about their own size once decoded (twice at the peak,
    # while the decoder runs, for arrays of 64 KiB or more) but other values become
    # Python objects, tens to a few hundred times their msgpack bytes".
    wire = pytest.importorskip("omni_requests.wire")
    import tracemalloc

    def ratio(record: TextPrompt) -> float:
        # The least of three decodes: a decode can also grow a table every record shares
        # (the registry of records' own arrays), once, by an amount set by how many arrays
        # the process holds (a 24 KiB message measured 1.9x once in CI, after 2,000 tests).
        message = wire.encode(record)
        peaks = []
        for _ in range(3):
            tracemalloc.start()
            try:
                wire.decode(message)
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
        return min(peaks) / len(message)

    frames = np.random.default_rng(0).integers(0, 256, (8, 128, 128, 3), dtype=np.uint8)  # 384 KiB
    assert ratio(TextPrompt(prompt="x", multi_modal_data={"video": frames})) < 2.5
    small_frames = frames[:, :32, :32]  # 24 KiB: not protected, no second copy
    assert ratio(TextPrompt(prompt="x", multi_modal_data={"video": small_frames})) < 1.5
    values: list[object] = [0, "", [], {}]
    small = [ratio(TextPrompt(prompt="x", mm_processor_kwargs={"v": [v] * 20_000})) for v in values]
    assert 10 < max(small) < 500


# -- docs/property-testing.md --


def test_the_property_table_names_exactly_the_checked_properties() -> None:
    # property-testing.md: the table of properties, and "a full check costs nine times one search".
    pytest.importorskip("hypothesis")
    from omni_requests.testing import PROPERTIES

    text = (ROOT / "docs" / "property-testing.md").read_text(encoding="utf-8")
    table = re.findall(
        r"^\| `(\w+)` \| ", text.split("## What is checked")[1].split("\n## ")[0], re.MULTILINE
    )
    assert table == list(PROPERTIES)
    assert len(PROPERTIES) == 9 and "costs nine times one search" in text
