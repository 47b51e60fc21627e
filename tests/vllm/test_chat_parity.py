"""Chat parity, generated: vLLM's own chat path and ``chat_to_prompt(renderer=...)`` agree.

A Hypothesis corpus of OpenAI-style conversations (system messages, several turns, every
content part vLLM 0.34 accepts for the tiny Qwen2-VL, data URLs and allowed local files,
``image_pil``, JPEG-frame videos and video files (MP4 and AVI written with OpenCV, read by
vLLM's OpenCV video loader), per-part ``uuid``s, names, tool calls and tool results) is
rendered (a) by vLLM's own offline chat preprocessing (``OfflineInferenceMixin._preprocess_chat``,
what ``LLM.chat`` runs) and (b) through the library into a record, then ``to_vllm`` into
the same renderer: identical prompt token ids, placeholders and unscoped ``mm_hashes``;
the scoped record carries ``stage0:rep{R}:<vLLM's chat key>``. Refusals name the part.

The stand-in (``chat_to_prompt`` without a renderer), given the model's placeholders and
the same template through the model's tokenizer, renders vLLM's own prompt text on a
second corpus (empty text parts, placeholders the user wrote, images and videos mixed,
typeless parts, uuids, parts vLLM refuses), or refuses where vLLM refuses.

Audio and embedding parts: ``test_chat_parity_audio.py`` (Qwen2-Audio, and renderers with
``enable_mm_embeds``). The shared property and helpers: ``_chat_parity.py``.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import re
import shutil
import types
from pathlib import Path
from typing import Any

import _tiny_models as tm
import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import cv2
import numpy as np
from _chat_parity import (
    CORPUS_SETTINGS,
    RENDERINGS,
    TEMPLATE,
    assert_same_rendering,
    check_parity,
    check_rendering,
    one_uuid_over_other_media,
    texts,
    uuids,
    vllm_chat,
    weighted,
    with_uuid,
)
from _chat_parity import (
    conversations as chat_conversations,
)
from hypothesis import event, given, settings
from hypothesis import strategies as st
from PIL import Image
from vllm.exceptions import VLLMValidationError

from omni_requests import InvalidPromptError, OmniRequestsError, PromptTypeError, TextPrompt
from omni_requests_omni import DefaultLoader, MediaLoadError, chat_to_prompt
from omni_requests_vllm import to_vllm

pytestmark = pytest.mark.vllm


def _image(seed: int, side: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


# Video files OpenCV writes here (its bundled FFmpeg): container suffix, FourCC, MIME type.
VIDEO_FORMATS = {"mp4": ("mp4v", "video/mp4"), "avi": ("MJPG", "video/x-msvideo")}


def _write_video(path: Path, fourcc: str, seed: int, frames: int) -> bytes:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 4.0, (56, 56))
    assert writer.isOpened(), f"OpenCV cannot write {path.suffix} ({fourcc})"
    rng = np.random.default_rng(seed)
    for _ in range(frames):
        writer.write(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
    writer.release()
    return path.read_bytes()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat_media")
    for seed in range(3):
        (folder / f"cat{seed}.png").write_bytes(_encoded(_image(100 + seed, 56), "PNG"))
    for suffix, (fourcc, _) in VIDEO_FORMATS.items():
        for seed in range(2):
            _write_video(folder / f"clip{seed}.{suffix}", fourcc, seed, frames=2 + 2 * seed)
    return folder


@pytest.fixture(scope="module")
def renderer(uncached_renderer: Any, media_dir: Path) -> Any:
    return uncached_renderer("qwen2_vl", allowed_local_media_path=str(media_dir))


# -- the corpus ---------------------------------------------------------------------------


@st.composite
def image_parts(draw: st.DrawFn) -> dict[str, Any]:
    image = _image(draw(st.integers(0, 5)), draw(st.sampled_from([28, 56, 70])))
    # vLLM takes a bare-str image_url only with a uuid: without one it is a refusal case.
    kind = draw(
        st.sampled_from(["image_url", "image_url", "image_url_str", "input_image", "image_pil", "file"])
    )
    url = f"data:image/png;base64,{base64.b64encode(_encoded(image, draw(st.sampled_from(['PNG', 'JPEG'])))).decode()}"
    part: dict[str, Any]
    if kind == "image_url":
        part = {"type": "image_url", "image_url": {"url": url}}
    elif kind == "image_url_str":  # vLLM's simple form: the URL as a bare string
        part = {"type": "image_url", "image_url": url}
    elif kind == "input_image":  # the Responses API's part
        part = {"type": "input_image", "image_url": url}
    elif kind == "image_pil":
        part = {"type": "image_pil", "image_pil": image}
    else:
        part = {
            "type": "image_url",
            "image_url": {"url": f"file://{{media_dir}}/cat{draw(st.integers(0, 2))}.png"},
        }
    uuid = draw(uuids)
    if uuid is not None:
        part["uuid"] = uuid
    return part


@st.composite
def video_parts(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["jpeg_frames", "jpeg_frames", "file_data_url", "file"]))
    if kind == "jpeg_frames":  # vLLM's frames form: data:video/jpeg;base64,<frame>,<frame>
        seed, frames = draw(st.integers(0, 3)), draw(st.sampled_from([2, 4]))
        encoded = [
            base64.b64encode(_encoded(_image(seed * 10 + i, 56), "JPEG")).decode() for i in range(frames)
        ]
        url = "data:video/jpeg;base64," + ",".join(encoded)
    else:  # a video file OpenCV wrote, sent inline or as an allowed local file
        suffix, seed = draw(st.sampled_from(sorted(VIDEO_FORMATS))), draw(st.integers(0, 1))
        name = f"clip{seed}.{suffix}"
        url = (
            f"data:{VIDEO_FORMATS[suffix][1]};base64,{{{name}}}"
            if kind == "file_data_url"
            else f"file://{{media_dir}}/{name}"
        )
    return with_uuid({"type": "video_url", "video_url": {"url": url}}, draw(uuids))


def conversations() -> st.SearchStrategy[list[dict[str, Any]]]:
    return chat_conversations(st.one_of(image_parts(), video_parts()))


def _resolved(messages: list[dict[str, Any]], media_dir: Path) -> list[dict[str, Any]]:
    """The messages with ``{media_dir}`` and ``{clip0.mp4}``-style file placeholders filled in."""
    out = copy.deepcopy(messages)  # PIL images copy too; both paths get equal content
    for message in out:
        for part in message["content"] if isinstance(message["content"], list) else ():
            for key in ("image_url", "video_url"):
                if isinstance(part, dict) and isinstance(part.get(key), dict):
                    url = part[key]["url"].replace("{media_dir}", str(media_dir))
                    if url.startswith("data:video/") and url.endswith("}"):
                        head, _, name = url.partition("{")
                        url = head + base64.b64encode((media_dir / name[:-1]).read_bytes()).decode()
                    part[key]["url"] = url
    return out


@settings(CORPUS_SETTINGS, max_examples=25)
@given(
    conversation=conversations(),
    **RENDERINGS,
)
def test_generated_conversations_render_like_vllms_own_chat_path(
    renderer: Any,
    media_dir: Path,
    conversation: list[dict[str, Any]],
    content_format: str,
    add_generation_prompt: bool,
    replica: int,
) -> None:
    check_rendering(
        renderer, _resolved(conversation, media_dir), content_format, add_generation_prompt, replica
    )


# -- fixed cases --------------------------------------------------------------------------


def _png_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(_encoded(_image(seed, 56), "PNG")).decode()


def test_placeholders_go_before_the_text_unless_interleaved(renderer: Any) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is"},
                {"type": "image_url", "image_url": {"url": _png_url(1)}},
                {"type": "text", "text": "this ?"},
            ],
        }
    ]
    record = chat_to_prompt(
        messages, renderer=renderer, chat_template=TEMPLATE, chat_template_content_format="string"
    )
    assert record.prompt is not None
    assert "<|vision_start|><|image_pad|><|vision_end|>\nwhat is\nthis ?" in record.prompt
    assert_same_rendering(
        vllm_chat(
            renderer, copy.deepcopy(messages), chat_template=TEMPLATE, chat_template_content_format="string"
        ),
        renderer.render_cmpl([to_vllm(record)])[0],
    )


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_a_tuple_of_parts_renders_as_vllm_renders_it(renderer: Any, content_format: str) -> None:
    # vLLM iterates a message's content whatever sequence holds its parts; the renderer
    # road refused a tuple the stand-in took (found by an adversarial review).
    parts = ({"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": _png_url(2)}})
    messages = [{"role": "user", "content": parts}]
    options = {"chat_template": TEMPLATE, "chat_template_content_format": content_format}
    assert check_parity(renderer, messages, 1, **options) == "rendered"


def test_an_llm_renders_with_the_chat_template_it_was_built_with(renderer: Any) -> None:
    # LLM.chat uses LLM(chat_template=...) where the call names none (vLLM's own
    # _preprocess_chat reads llm.chat_template); given only the renderer, that template
    # is unknown. Given the LLM (here the attributes _preprocess_chat reads of one),
    # chat_to_prompt renders with it; a template named in the call still wins.
    from vllm.entrypoints.common.offline import OfflineInferenceMixin

    llm_template = "LLM-TEMPLATE " + TEMPLATE
    llm = types.SimpleNamespace(
        renderer=renderer, model_config=renderer.model_config, chat_template=llm_template
    )
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(3)}}, "hi"]}]
    (expected,) = OfflineInferenceMixin._preprocess_chat(llm, [copy.deepcopy(messages)])  # type: ignore[arg-type]
    record = chat_to_prompt(messages, renderer=llm)
    assert record.prompt is not None and record.prompt.startswith("LLM-TEMPLATE")
    assert_same_rendering(expected, renderer.render_cmpl([to_vllm(record)])[0])
    named = chat_to_prompt(messages, renderer=llm, chat_template=TEMPLATE)
    assert named.prompt is not None and not named.prompt.startswith("LLM-TEMPLATE")
    assert named == chat_to_prompt(messages, renderer=renderer, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def templated_renderer(tiny_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Qwen2-VL with a chat template of its tokenizer's own, which a renderer
    uses where no template is named."""
    folder = tmp_path_factory.mktemp("qwen2_vl_templated")
    shutil.copytree(tiny_models["qwen2_vl"].folder, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = "TOKENIZER-TEMPLATE " + TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tm.build_renderer(folder, mm_processor_cache_gb=0)


def test_a_real_llm_renders_with_its_own_template_file_over_the_tokenizers(
    templated_renderer: Any, tmp_path: Path
) -> None:
    # LLM(model, chat_template="chat.jinja").chat(messages) renders with that file, not the
    # tokenizer's template; chat_to_prompt(renderer=llm.llm_engine.renderer) rendered with
    # the tokenizer's. LLM.__init__ starts an engine, which this CPU install cannot (no
    # compiled ops), so the LLM gets the attributes __init__ sets that chat rendering reads,
    # its template loaded by vLLM's own load_chat_template as __init__ loads it.
    from vllm import LLM
    from vllm.renderers.chat_utils import load_chat_template

    template_file = tmp_path / "chat.jinja"
    template_file.write_text("LLM-TEMPLATE " + TEMPLATE, encoding="utf-8")
    llm = LLM.__new__(LLM)
    llm.renderer = templated_renderer
    llm.model_config = templated_renderer.model_config
    llm.chat_template = load_chat_template(str(template_file))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(4)}}, "hi"]}]
    expected = llm._preprocess_chat_one(copy.deepcopy(messages))  # what LLM.chat hands the engine
    record = chat_to_prompt(messages, renderer=llm)
    assert record.prompt == expected["prompt"] and record.prompt.startswith("LLM-TEMPLATE")
    assert_same_rendering(expected, templated_renderer.render_cmpl([to_vllm(record)])[0])
    # The engine's renderer alone knows only the tokenizer's template: another prompt.
    alone = chat_to_prompt(messages, renderer=llm.renderer)
    assert alone.prompt is not None and alone.prompt.startswith("TOKENIZER-TEMPLATE")
    assert chat_to_prompt(messages, renderer=llm.renderer, chat_template=llm.chat_template) == record


@pytest.mark.parametrize("suffix", sorted(VIDEO_FORMATS))
@pytest.mark.parametrize("inline", [True, False], ids=["data_url", "file"])
def test_a_video_file_renders_through_vllms_video_loader(
    renderer: Any, media_dir: Path, suffix: str, inline: bool
) -> None:
    # vLLM decodes it with OpenCV (pinned); its key is the file bytes' key, in the record too.
    url = (
        f"data:{VIDEO_FORMATS[suffix][1]};base64,{{clip1.{suffix}}}"
        if inline
        else f"file://{{media_dir}}/clip1.{suffix}"
    )
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, "describe"]}]
    assert check_parity(renderer, _resolved(messages, media_dir), 1, chat_template=TEMPLATE) == "rendered"


def test_tool_calls_and_names_reach_the_template(renderer: Any) -> None:
    messages = [
        {"role": "user", "name": "ada", "content": "hello"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "look", "arguments": '{"n": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "cat"}]},
    ]
    record = chat_to_prompt(messages, renderer=renderer, chat_template=TEMPLATE)
    assert record.prompt is not None
    assert "user ada" in record.prompt and 'look {"n": 1}' in record.prompt and "cat c1" in record.prompt
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"n": 1}'  # the caller's untouched


@pytest.mark.parametrize(
    ("part", "error", "message"),
    [
        (
            {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}},
            MediaLoadError,
            "vLLM refuses it",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGEgcG5n"}},
            MediaLoadError,
            "vLLM refuses it",
        ),
        ({"type": "file", "file": {}}, InvalidPromptError, "Unsupported chat content part type: 'file'"),
        ({"type": "image_embeds", "image_embeds": "AAAA"}, InvalidPromptError, "enable-mm-embeds"),
        (
            {"type": "prompt_embeds", "data": "AAAA"},
            InvalidPromptError,
            "prompt_embeds parts are not supported",
        ),
    ],
)
def test_what_vllm_refuses_is_refused_naming_the_message_and_part(
    renderer: Any, part: dict[str, Any], error: type[Exception], message: str
) -> None:
    messages = [
        {"role": "system", "content": "hello"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, part]},
    ]
    if part["type"] != "prompt_embeds":
        with pytest.raises(Exception):  # noqa: B017 - vLLM refuses it in its own way
            vllm_chat(renderer, copy.deepcopy(messages), chat_template=TEMPLATE)
    with pytest.raises(error, match=r"^\$\.messages\[2\]\.content\[1\]: .*" + message):
        chat_to_prompt(messages, renderer=renderer, chat_template=TEMPLATE)


def test_a_template_refusal_names_the_messages(renderer: Any) -> None:
    strict = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "system", "content": "a"}]
    with pytest.raises(InvalidPromptError, match=r"^\$\.messages: vLLM refuses it: .*no system"):
        chat_to_prompt(messages, renderer=renderer, chat_template=strict)


def test_a_malformed_tool_call_names_the_tool_calls(renderer: Any) -> None:
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None, "tool_calls": ["not an object"]},
    ]
    with pytest.raises(Exception):  # noqa: B017
        vllm_chat(renderer, copy.deepcopy(messages), chat_template=TEMPLATE)
    with pytest.raises(
        InvalidPromptError, match=r"^\$\.messages\[1\]\.tool_calls: vLLM refuses it: .*objects"
    ):
        chat_to_prompt(messages, renderer=renderer, chat_template=TEMPLATE)


# -- parts vLLM refuses, refused on both paths ------------------------------------------


@pytest.mark.parametrize(
    ("part", "path"),
    [
        ({"text": "no type"}, r"\$\.messages\[1\]\.content\[1\]"),
        ({"type": "text", "text": "a", "uuid": "u-1"}, r"\$\.messages\[1\]\.content\[1\]\.uuid"),
        ({"type": "input_text", "text": "a", "uuid": "u-1"}, r"\$\.messages\[1\]\.content\[1\]\.uuid"),
        ({"type": "image_url", "uuid": "u-1"}, r"\$\.messages\[1\]\.content\[1\]\.uuid"),
    ],
    ids=["no_type", "uuid_on_text", "uuid_on_input_text", "uuid_without_media_field"],
)
def test_a_part_vllm_refuses_is_refused_on_both_paths_naming_it(
    renderer: Any, part: dict[str, Any], path: str
) -> None:
    # vLLM reads a part with a uuid, or without a type, by its media field and refuses one
    # that has none; the stand-in took these (the last as a cached-only image).
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(2)}}, part]},
    ]
    with pytest.raises(VLLMValidationError, match="Missing 'type' field"):
        vllm_chat(renderer, copy.deepcopy(messages), chat_template=TEMPLATE)
    with pytest.raises(InvalidPromptError, match=r"^\$\.messages\[1\]\.content\[1\]: vLLM refuses it"):
        chat_to_prompt(messages, renderer=renderer, chat_template=TEMPLATE)
    seen: list[str] = []

    def loader(modality: str, url: str) -> object:
        seen.append(modality)
        return DefaultLoader()(modality, url)

    with pytest.raises(InvalidPromptError, match=f"^{path}: "):
        chat_to_prompt(messages, loader=loader)
    assert seen == []  # refused before the image before it was loaded


def test_one_uuid_over_two_images_is_refused_and_over_one_image_twice_taken(renderer: Any) -> None:
    # vLLM keys both parts by the uuid alone, so it would serve the second image the first's
    # features; the same image twice under one uuid is one item, keyed as vLLM keys it.
    def conversation(second: str) -> list[dict[str, Any]]:
        parts = [
            {"type": "image_url", "image_url": {"url": url}, "uuid": "u-cat"} for url in (_png_url(2), second)
        ]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this"}]}]

    assert check_parity(renderer, conversation(_png_url(3)), 1, chat_template=TEMPLATE) == (
        "refused: one uuid over two items"
    )
    with pytest.raises(InvalidPromptError, match="'u-cat' also names") as caught:
        chat_to_prompt(conversation(_png_url(3)), renderer=renderer, chat_template=TEMPLATE)
    assert caught.value.path == "$.messages[0].content[1]"
    assert check_parity(renderer, conversation(_png_url(2)), 1, chat_template=TEMPLATE) == "rendered"


# -- the stand-in (no renderer) beside vLLM's own chat text -------------------------------

IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"
# The stand-in's path names the message, its content, a part, or a field of the part.
_STAND_IN_REFUSAL = re.compile(r"^\$\.messages\[\d+\](\.content(\[\d+\](\.\w+){0,2})?)?$")


def stand_in_chat(renderer: Any, messages: list[dict[str, Any]]) -> TextPrompt:
    """``chat_to_prompt`` without a renderer, given this model's placeholders and ``TEMPLATE``
    through the model's tokenizer (what the docs tell a stand-in user to pass)."""
    tokenizer = renderer.get_tokenizer()

    def template(turns: list[dict[str, str]]) -> str:
        text = tokenizer.apply_chat_template(
            turns, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return text

    record = chat_to_prompt(
        messages, template=template, placeholders={"image": IMAGE_MARK, "video": VIDEO_MARK}
    )
    assert isinstance(record, TextPrompt)
    return record


def check_stand_in(renderer: Any, messages: list[dict[str, Any]]) -> str:
    """The stand-in renders vLLM's own prompt text (string content format) with the same
    items and uuids, or refuses, naming the place, what vLLM refuses."""
    try:
        expected = vllm_chat(
            renderer, copy.deepcopy(messages), chat_template=TEMPLATE, chat_template_content_format="string"
        )
    except Exception as refusal:  # noqa: BLE001 - vLLM refuses this conversation
        with pytest.raises(OmniRequestsError) as caught:
            stand_in_chat(renderer, messages)
        assert _STAND_IN_REFUSAL.match(caught.value.path), caught.value.path
        return f"both refuse: {type(refusal).__name__}: {str(refusal)[:40]}"
    if one_uuid_over_other_media(renderer, messages):
        with pytest.raises(InvalidPromptError, match="also names multi_modal_data") as caught:
            stand_in_chat(renderer, messages)
        assert _STAND_IN_REFUSAL.match(caught.value.path), caught.value.path
        return "vLLM renders, the stand-in refuses: one uuid over two items"
    record = stand_in_chat(renderer, messages)
    assert record.prompt == expected["prompt"]
    placed = expected.get("mm_placeholders") or {}
    assert {modality: len(items) for modality, items in record.multi_modal_data.items()} == {
        modality: len(ranges) for modality, ranges in placed.items()
    }
    for modality, row in (record.multi_modal_uuids or {}).items():  # vLLM keys an item by its uuid
        for uuid, key in zip(row, expected["mm_hashes"][modality], strict=True):
            assert uuid is None or uuid == key
    return "rendered"


stand_in_texts = st.one_of(
    texts,
    st.just(""),  # vLLM's parser drops an empty part
    texts.map(lambda t: f"{t} {IMAGE_MARK}"),  # the user placed the image: vLLM adds none
    st.just(f"{IMAGE_MARK} {IMAGE_MARK}"),
    st.just(f"{VIDEO_MARK} ?"),
)
stand_in_text_parts = weighted(
    # Weighted so most conversations render: one refused part refuses the whole conversation.
    (12, stand_in_texts),
    (12, stand_in_texts.map(lambda t: {"type": "text", "text": t})),
    (4, stand_in_texts.map(lambda t: {"type": "input_text", "text": t})),
    (2, st.just({"type": "text", "text": None})),
    (1, st.just({"text": "no type"})),  # vLLM refuses: no type and no media field
    (1, st.just({"type": "text", "text": "a", "uuid": "u-cat"})),  # vLLM refuses: a uuid, no media field
)


@st.composite
def stand_in_media(draw: st.DrawFn) -> dict[str, Any]:
    seed = draw(st.integers(0, 2))
    kind = draw(st.sampled_from(["image", "image", "typeless_image", "typed_otherwise", "video"]))
    uuid = draw(uuids)
    if kind == "video":  # JPEG frames, which vLLM's video IO reads in both paths
        frames = [base64.b64encode(_encoded(_image(seed * 10 + i, 56), "JPEG")).decode() for i in range(2)]
        url = "data:video/jpeg;base64," + ",".join(frames)
        return with_uuid({"type": "video_url", "video_url": {"url": url}}, uuid)
    image = {"url": _png_url(seed)}
    if kind == "typeless_image":  # vLLM reads a part without a type by its media field
        return with_uuid({"image_url": image}, uuid)
    if kind == "typed_otherwise":  # with a uuid, vLLM reads the field, not the type: an image
        return {"type": "video_url", "image_url": image, "uuid": uuid or "u-dog"}
    return with_uuid({"type": "image_url", "image_url": image}, uuid)


@st.composite
def stand_in_conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    for turn in range(draw(st.integers(1, 2))):
        if turn:
            messages.append({"role": "assistant", "content": draw(texts)})
        parts = st.one_of(stand_in_text_parts, stand_in_media())
        messages.append({"role": "user", "content": draw(st.lists(parts, min_size=1, max_size=4))})
    return messages


@settings(CORPUS_SETTINGS, max_examples=40)
@given(conversation=stand_in_conversations())
def test_the_stand_in_renders_vllms_own_text_for_generated_conversations(
    renderer: Any, conversation: list[dict[str, Any]]
) -> None:
    # Given the model's template and placeholders, the stand-in's turns are vLLM's: it
    # placed one placeholder per item even where the text held it, kept empty parts as
    # blank lines, and took parts vLLM refuses (no type, a uuid without media).
    event(check_stand_in(renderer, conversation))


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, "", {"type": "text", "text": "b"}],
        [
            {"type": "text", "text": f"look {IMAGE_MARK} here"},
            {"type": "image_url", "image_url": {"url": "{png}"}},
        ],
        [
            {"type": "image_url", "image_url": {"url": "{png}"}},
            {"type": "video_url", "video_url": {"url": "{frames}"}},
            {"type": "image_url", "image_url": {"url": "{png}"}},
            "what is this ?",
        ],
    ],
    ids=["empty_text_parts", "placeholder_in_text", "grouped_by_modality"],
)
def test_the_stand_in_places_placeholders_as_vllm_does(renderer: Any, content: list[Any]) -> None:
    frames = base64.b64encode(_encoded(_image(7, 56), "JPEG")).decode()
    fill = {"{png}": _png_url(1), "{frames}": f"data:video/jpeg;base64,{frames},{frames}"}
    content = copy.deepcopy(content)  # the parameters stay as written
    for part in content:
        for key in ("image_url", "video_url"):
            if isinstance(part, dict) and key in part:
                part[key]["url"] = fill[part[key]["url"]]
    assert check_stand_in(renderer, [{"role": "user", "content": content}]) == "rendered"


_PNG = "{png}"
_FRAMES = "{frames}"
# Each part shape vLLM takes or refuses. Typed and without a uuid, vLLM validates a part
# against OpenAI's schema (bare URL strs refused, input_image needs a detail); with a
# uuid or without a type it reads the media field loosely. An int uuid is read as its str.
PART_SHAPES = {
    "image_url_str": {"type": "image_url", "image_url": _PNG},
    "image_url_str_uuid": {"type": "image_url", "image_url": _PNG, "uuid": "u-bare"},
    "image_url_empty_url": {"type": "image_url", "image_url": {"url": ""}},
    "image_url_detail": {"type": "image_url", "image_url": {"url": _PNG, "detail": "low"}},
    "image_url_bad_detail": {"type": "image_url", "image_url": {"url": _PNG, "detail": "max"}},
    "image_url_no_url": {"type": "image_url", "image_url": {"detail": "auto"}},
    "input_image_no_detail": {"type": "input_image", "image_url": _PNG},
    "input_image": {"type": "input_image", "image_url": _PNG, "detail": "auto"},
    "input_image_object": {"type": "input_image", "image_url": {"url": _PNG}, "detail": "auto"},
    "input_image_object_uuid": {"type": "input_image", "image_url": {"url": _PNG}, "uuid": "u-in"},
    "input_image_no_url": {"type": "input_image", "detail": "high"},
    "int_uuid": {"type": "image_url", "image_url": {"url": _PNG}, "uuid": 7},
    "video_url_str": {"type": "video_url", "video_url": _FRAMES},
    "video_url_str_uuid": {"type": "video_url", "video_url": _FRAMES, "uuid": "u-vid"},
    "typeless_str": {"image_url": _PNG},
}


def _filled(part: dict[str, Any]) -> dict[str, Any]:
    frames = base64.b64encode(_encoded(_image(7, 56), "JPEG")).decode()
    fill = {_PNG: _png_url(1), _FRAMES: f"data:video/jpeg;base64,{frames},{frames}"}
    part = copy.deepcopy(part)  # the parameters stay as written
    for key in ("image_url", "video_url"):
        value = part.get(key)
        if isinstance(value, dict) and "url" in value:
            value["url"] = fill.get(value["url"], value["url"])
        elif isinstance(value, str):
            part[key] = fill[value]
    return part


@pytest.mark.parametrize("part", list(PART_SHAPES.values()), ids=list(PART_SHAPES))
def test_the_stand_in_takes_and_refuses_each_part_shape_as_vllm_does(
    renderer: Any, part: dict[str, Any]
) -> None:
    # The stand-in used to take every bare URL str and input_image without its detail, and
    # refused an int uuid.
    check_stand_in(renderer, [{"role": "user", "content": ["what is it?", _filled(part)]}])


_PRINTS_ALIKE = np.arange(2000)  # numpy prints the first and last three elements of it


@pytest.mark.parametrize(
    "uuid", [_PRINTS_ALIKE, object(), 1.5, True], ids=["array", "object", "float", "bool"]
)
def test_a_uuid_that_is_not_a_str_or_an_int_is_refused_on_both_paths(renderer: Any, uuid: object) -> None:
    # vLLM keys the item by str(uuid): another array prints alike, and an object prints its
    # address, which the next request's object may reuse; both would share a cache entry.
    other = _PRINTS_ALIKE.copy()
    other[1000] = -1
    assert str(other) == str(_PRINTS_ALIKE)
    part = _filled({"type": "image_url", "image_url": {"url": _PNG}, "uuid": uuid})
    messages = [{"role": "user", "content": [part]}]
    for on_vllm in ({}, {"renderer": renderer, "chat_template": TEMPLATE}):
        with pytest.raises(PromptTypeError, match=r"must be a str \(or an int") as caught:
            chat_to_prompt(messages, **on_vllm)
        assert caught.value.path == "$.messages[0].content[0].uuid"


def test_an_empty_uuid_is_refused_on_both_paths_though_vllm_keys_it_as_empty(renderer: Any) -> None:
    # vLLM keys such an item "": every item given uuid "" would share one cache entry.
    messages = [
        {"role": "user", "content": [_filled({"type": "image_url", "image_url": {"url": _PNG}, "uuid": ""})]}
    ]
    assert vllm_chat(renderer, copy.deepcopy(messages), chat_template=TEMPLATE)["mm_hashes"] == {
        "image": [""]
    }
    with pytest.raises(InvalidPromptError, match="every item needs its own key") as caught:
        chat_to_prompt(messages)
    assert caught.value.path == "$.messages[0].content[0].uuid"
    with pytest.raises(InvalidPromptError, match="every item needs its own key") as caught:
        chat_to_prompt(messages, renderer=renderer, chat_template=TEMPLATE)
    assert caught.value.path == "$.messages[0].content[0].uuid"  # before vLLM sees it
