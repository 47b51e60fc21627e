"""Chat parity, generated: vLLM's own chat path and ``chat_to_prompt(renderer=...)`` agree.

A Hypothesis corpus of OpenAI-style conversations (system messages, several turns, every
content part vLLM 0.34 accepts for the tiny Qwen2-VL, data URLs and allowed local files,
``image_pil``, per-part ``uuid``s, names, tool calls and tool results) is rendered (a) by
vLLM's own offline chat preprocessing (``OfflineInferenceMixin._preprocess_chat``, what
``LLM.chat`` runs) and (b) through the library into a record, then ``to_vllm`` into the
same renderer: identical prompt token ids, placeholders and unscoped ``mm_hashes``; the
scoped record carries ``stage0:rep{R}:<vLLM's chat key>``. Refusals name the part.

Audio is not in the corpus: this CPU install has none of vLLM's audio decoders
(soundfile, PyAV, torchcodec), so vLLM itself refuses every audio URL; the test below
shows the library refuses it too, naming the part.
"""

from __future__ import annotations

import base64
import copy
import io
import re
import types
from pathlib import Path
from typing import Any

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from omni_requests import InvalidPromptError, MediaHasher, OmniRequestsError, TokensPrompt, scope_to_replica
from omni_requests_omni import MediaLoadError, chat_to_prompt
from omni_requests_vllm import to_vllm

pytestmark = pytest.mark.vllm

# A template that uses every message field vLLM hands it, for both content formats.
TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{% if message.get('name') %} {{ message['name'] }}{% endif %}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{%- if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    " {{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
    "{%- if message.get('tool_call_id') %} {{ message['tool_call_id'] }}{% endif %}<|im_end|>\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
WORDS = ("a", "the", "cat", "dog", "what", "is", "this", "?", "describe", "hello world", "Ünknown")


def _image(seed: int, side: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat_media")
    for seed in range(3):
        (folder / f"cat{seed}.png").write_bytes(_encoded(_image(100 + seed, 56), "PNG"))
    return folder


@pytest.fixture(scope="module")
def renderer(uncached_renderer: Any, media_dir: Path) -> Any:
    return uncached_renderer("qwen2_vl", allowed_local_media_path=str(media_dir))


# -- the corpus ---------------------------------------------------------------------------

uuids = st.one_of(st.none(), st.sampled_from(["u-cat", "u-dog", "7"]))


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
    seed, frames = draw(st.integers(0, 3)), draw(st.sampled_from([2, 4]))
    encoded = [base64.b64encode(_encoded(_image(seed * 10 + i, 56), "JPEG")).decode() for i in range(frames)]
    part: dict[str, Any] = {
        "type": "video_url",
        "video_url": {"url": "data:video/jpeg;base64," + ",".join(encoded)},
    }
    uuid = draw(uuids)
    if uuid is not None:
        part["uuid"] = uuid
    return part


texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(" ".join)
text_parts = st.one_of(
    texts.map(lambda t: {"type": "text", "text": t}),
    texts.map(lambda t: {"type": "input_text", "text": t}),
    texts.map(lambda t: {"type": "refusal", "refusal": t}),
    texts.map(lambda t: {"type": "thinking", "thinking": t}),
    texts,  # a bare string part
)


@st.composite
def user_turns(draw: st.DrawFn) -> dict[str, Any]:
    parts = draw(st.lists(st.one_of(text_parts, image_parts(), video_parts()), min_size=1, max_size=4))
    message: dict[str, Any] = {"role": "user", "content": draw(st.one_of(texts, st.just(parts)))}
    if draw(st.booleans()):
        message["name"] = draw(st.sampled_from(["ada", "bob"]))
    return message


@st.composite
def assistant_turns(draw: st.DrawFn) -> list[dict[str, Any]]:
    if not draw(st.booleans()):
        return [{"role": "assistant", "content": draw(st.one_of(texts, st.lists(text_parts, max_size=2)))}]
    arguments = draw(st.sampled_from(['{"city": "cat"}', "{}", "", "not json", "[1, 2]", {"n": 1}]))
    call = {"id": "call-1", "type": "function", "function": {"name": "look", "arguments": arguments}}
    return [
        {"role": "assistant", "content": draw(st.one_of(st.none(), texts)), "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call-1",
            "content": draw(
                st.one_of(
                    texts,
                    st.lists(
                        texts.map(lambda t: {"type": "text", "text": t}),
                        min_size=1,
                        max_size=2,
                    ),
                )
            ),
        },
    ]


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append(
            {
                "role": "system",
                "content": draw(st.one_of(texts, st.lists(text_parts, min_size=1, max_size=2))),
            }
        )
    for _ in range(draw(st.integers(1, 2))):
        messages.append(draw(user_turns()))
        if draw(st.booleans()):
            messages.extend(draw(assistant_turns()))
    messages.append(draw(user_turns()))
    return messages


def _resolved(messages: list[dict[str, Any]], media_dir: Path) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)  # PIL images copy too; both paths get equal content
    for message in out:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if isinstance(part, dict) and isinstance(part.get("image_url"), dict):
                part["image_url"]["url"] = part["image_url"]["url"].replace("{media_dir}", str(media_dir))
    return out


# -- vLLM's own chat path -----------------------------------------------------------------


def vllm_chat(renderer: Any, messages: list[dict[str, Any]], **options: Any) -> Any:
    """What ``LLM.chat`` sends the engine: vLLM's own ``_preprocess_chat`` on this renderer."""
    from vllm.entrypoints.common.offline import OfflineInferenceMixin

    llm = types.SimpleNamespace(renderer=renderer, model_config=renderer.model_config, chat_template=None)
    (engine_input,) = OfflineInferenceMixin._preprocess_chat(llm, [messages], **options)  # type: ignore[arg-type]
    return engine_input


def library_chat(renderer: Any, messages: list[dict[str, Any]], **options: Any) -> tuple[TokensPrompt, Any]:
    record = chat_to_prompt(messages, renderer=renderer, **options)
    (engine_input,) = renderer.render_cmpl([to_vllm(record)])
    return record, engine_input


def _hasher(renderer: Any) -> MediaHasher:
    config = renderer.model_config.multimodal_config
    return MediaHasher(renderer.model_config.model, config.mm_hasher_algorithm)


def assert_same_rendering(expected: Any, got: Any) -> None:
    assert got["prompt_token_ids"] == expected["prompt_token_ids"]
    assert got.get("mm_placeholders", {}) == expected.get("mm_placeholders", {})
    assert got.get("mm_hashes", {}) == expected.get("mm_hashes", {})


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(
    conversation=conversations(),
    content_format=st.sampled_from(["string", "openai"]),
    add_generation_prompt=st.booleans(),
    replica=st.integers(0, 3),
)
def test_generated_conversations_render_like_vllms_own_chat_path(
    renderer: Any,
    media_dir: Path,
    conversation: list[dict[str, Any]],
    content_format: str,
    add_generation_prompt: bool,
    replica: int,
) -> None:
    messages = _resolved(conversation, media_dir)
    options = {
        "chat_template": TEMPLATE,
        "chat_template_content_format": content_format,
        "add_generation_prompt": add_generation_prompt,
    }
    pristine = copy.deepcopy(messages)
    try:
        expected = vllm_chat(renderer, copy.deepcopy(messages), **options)
    except Exception:  # noqa: BLE001 - vLLM refuses this conversation (e.g. a bare-str image_url without a uuid)
        event("vLLM refuses")
        path = None
        try:
            record = chat_to_prompt(messages, renderer=renderer, **options)
        except OmniRequestsError as error:  # refused while parsing: the error names where
            path = error.path
        else:  # refused while processing: the record's dict is refused by the renderer too
            with pytest.raises(Exception):  # noqa: B017
                renderer.render_cmpl([to_vllm(record)])
        if path is not None:
            assert re.match(r"^\$\.messages(\[\d+\](\.content\[\d+\]|\.tool_calls)?)?$", path)
        assert messages == pristine
        return
    event("both render")
    record, got = library_chat(renderer, messages, **options)
    assert messages == pristine  # vLLM parses tool-call arguments in place; the library copies first
    assert_same_rendering(expected, got)
    # Scoped: every item's key is stage0:rep{R}: + vLLM's own chat key for it.
    scoped = scope_to_replica(record, replica, hasher=_hasher(renderer))
    sent = to_vllm(scoped).get("multi_modal_uuids", {})
    assert sent == {
        modality: [f"stage0:rep{replica}:{key}" for key in keys]
        for modality, keys in expected.get("mm_hashes", {}).items()
    }


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
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            OmniRequestsError,
            "vLLM refuses it",
        ),
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
