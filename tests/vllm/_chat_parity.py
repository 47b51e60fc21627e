"""What the chat parity modules share: both chat paths, the comparison, the text corpus.

Imported by ``test_chat_parity*.py`` after their ``pytest.importorskip("vllm")``.
:func:`check_parity` is the property each generated conversation must satisfy: vLLM's
own chat path (``OfflineInferenceMixin._preprocess_chat``, what ``LLM.chat`` runs) and
``chat_to_prompt(renderer=...)`` then ``to_vllm`` into the same renderer give identical
prompt token ids, placeholders and unscoped ``mm_hashes``; the record scoped to replica
R carries ``stage0:rep{R}:<vLLM's chat key>``; where vLLM refuses, the library refuses,
naming the message and part.
"""

from __future__ import annotations

import copy
import re
import types
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from omni_requests import MediaHasher, OmniRequestsError, TokensPrompt, scope_to_replica
from omni_requests_omni import chat_to_prompt
from omni_requests_vllm import to_vllm

WORDS = ("a", "the", "cat", "dog", "what", "is", "this", "?", "describe", "hello world", "Ünknown")

# Hypothesis settings for a corpus whose examples each run vLLM's chat path twice.
CORPUS_SETTINGS = settings(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

# A template that uses every message field vLLM hands it, for both content formats.
TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{% if message.get('name') %} {{ message['name'] }}{% endif %}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{%- if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    " {{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
    "{%- if message.get('tool_call_id') %} {{ message['tool_call_id'] }}{% endif %}<|im_end|>\n"
    "{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)

_REFUSAL_PATH = re.compile(r"^\$\.messages(\[\d+\](\.content\[\d+\]|\.tool_calls)?)?$")

texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(" ".join)
text_parts = st.one_of(
    texts.map(lambda t: {"type": "text", "text": t}),
    texts.map(lambda t: {"type": "input_text", "text": t}),
    texts.map(lambda t: {"type": "refusal", "refusal": t}),
    texts.map(lambda t: {"type": "thinking", "thinking": t}),
    texts,  # a bare string part
)
uuids = st.one_of(st.none(), st.sampled_from(["u-cat", "u-dog", "7"]))


@st.composite
def user_turns(draw: st.DrawFn, media: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    parts = draw(st.lists(st.one_of(text_parts, media), min_size=1, max_size=4))
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
    tool_content = st.one_of(
        texts, st.lists(texts.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=2)
    )
    return [
        {"role": "assistant", "content": draw(st.one_of(st.none(), texts)), "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": draw(tool_content)},
    ]


@st.composite
def conversations(
    draw: st.DrawFn, media: st.SearchStrategy[dict[str, Any]], *, media_last: bool = False
) -> list[dict[str, Any]]:
    """A system message or none, one or two user turns each maybe answered (text or a tool
    call and its result), then a last user turn; user parts are text or drawn from ``media``.
    With ``media_last`` the last turn ends with one more ``media`` part."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        system = draw(st.one_of(texts, st.lists(text_parts, min_size=1, max_size=2)))
        messages.append({"role": "system", "content": system})
    for _ in range(draw(st.integers(1, 2))):
        messages.append(draw(user_turns(media)))
        if draw(st.booleans()):
            messages.extend(draw(assistant_turns()))
    messages.append(draw(user_turns(media)))
    if media_last:
        last = messages[-1]
        content = last["content"] if isinstance(last["content"], list) else [last["content"]]
        last["content"] = [*content, draw(media)]
    return messages


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each drawn about ``weight`` times in the sum of weights."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


def with_uuid(part: dict[str, Any], uuid: str | None) -> dict[str, Any]:
    """The part with a ``uuid`` field where one is drawn."""
    return part if uuid is None else {**part, "uuid": uuid}


def vllm_chat(renderer: Any, messages: list[dict[str, Any]], **options: Any) -> Any:
    """What ``LLM.chat`` sends the engine: vLLM's own ``_preprocess_chat`` on this renderer."""
    from vllm.entrypoints.common.offline import OfflineInferenceMixin

    llm = types.SimpleNamespace(renderer=renderer, model_config=renderer.model_config, chat_template=None)
    (engine_input,) = OfflineInferenceMixin._preprocess_chat(llm, [messages], **options)  # type: ignore[arg-type]
    return engine_input


def library_chat(renderer: Any, messages: list[dict[str, Any]], **options: Any) -> tuple[TokensPrompt, Any]:
    """The record ``chat_to_prompt`` builds, and what the renderer makes of ``to_vllm(record)``."""
    record = chat_to_prompt(messages, renderer=renderer, **options)
    (engine_input,) = renderer.render_cmpl([to_vllm(record)])
    return record, engine_input


def hasher_of(renderer: Any) -> MediaHasher:
    config = renderer.model_config.multimodal_config
    return MediaHasher(renderer.model_config.model, config.mm_hasher_algorithm)


def assert_same_rendering(expected: Any, got: Any) -> None:
    assert got["prompt_token_ids"] == expected["prompt_token_ids"]
    assert got.get("mm_placeholders", {}) == expected.get("mm_placeholders", {})
    assert got.get("mm_hashes", {}) == expected.get("mm_hashes", {})


def one_uuid_over_other_media(renderer: Any, messages: list[dict[str, Any]]) -> bool:
    """Whether ``messages`` give one uuid to two items vLLM's own hasher tells apart.

    vLLM keys both by the uuid, so the second is served the first's features; records
    refuse it (a cached-only item under its sender's uuid is the same item). Decided from
    vLLM's own parse of the conversation and its ``MultiModalHasher``, not the library's.
    """
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages

    config = renderer.model_config
    _, data, uuids = parse_chat_messages(copy.deepcopy(messages), config, "string")
    parsed = renderer.get_mm_processor().info.parse_mm_data(data or {})  # as vLLM's renderer does
    algorithm = config.multimodal_config.mm_hasher_algorithm
    named: dict[str, tuple[str, str | None]] = {}
    for modality, row in (uuids or {}).items():
        if modality not in parsed:
            continue  # no data: vLLM keys nothing under these uuids
        for item, uuid in zip(parsed[modality].get_all_items_for_hash(), row, strict=True):
            if uuid is None:
                continue
            key = None if item is None else MultiModalHasher.hash_kwargs(algorithm, **{modality: item})
            first = named.get(str(uuid))
            if first is None or (first[1] is None and key is not None and first[0] == modality):
                named[str(uuid)] = (modality, key)
            elif first[0] != modality or (key is not None and key != first[1]):
                return True
    return False


def _note(what: str) -> None:
    if currently_in_test_context():  # fixed cases call check_parity too
        event(what)


def check_parity(renderer: Any, messages: list[dict[str, Any]], replica: int, **options: Any) -> str:
    """Assert the chat parity property for ``messages``; returns what happened (for ``event``)."""
    pristine = copy.deepcopy(messages)
    try:
        expected = vllm_chat(renderer, copy.deepcopy(messages), **options)
    except Exception as refusal:  # noqa: BLE001 - vLLM refuses this conversation
        _note(f"vLLM refuses: {type(refusal).__name__}: {str(refusal)[:50]}")
        path = None
        try:
            record = chat_to_prompt(messages, renderer=renderer, **options)
        except OmniRequestsError as error:  # refused while parsing: the error names where
            path = error.path
        else:  # refused while processing: the record's dict is refused by the renderer too
            with pytest.raises(Exception):  # noqa: B017
                renderer.render_cmpl([to_vllm(record)])
        if path is not None:
            assert _REFUSAL_PATH.match(path), path
        assert messages == pristine
        return "refused"
    if one_uuid_over_other_media(renderer, messages):
        _note("one uuid over two items: vLLM renders, the library refuses")
        with pytest.raises(OmniRequestsError, match="also names multi_modal_data") as caught:
            chat_to_prompt(messages, renderer=renderer, **options)
        assert _REFUSAL_PATH.match(caught.value.path), caught.value.path
        assert messages == pristine
        return "refused: one uuid over two items"
    _note("both render")
    _note("media: " + (", ".join(sorted(expected.get("mm_hashes") or {})) or "none"))
    record, got = library_chat(renderer, messages, **options)
    assert messages == pristine  # vLLM parses tool-call arguments in place; the library copies first
    assert_same_rendering(expected, got)
    # Scoped: every item's key is stage0:rep{R}: + vLLM's own chat key for it.
    scoped = scope_to_replica(record, replica, hasher=hasher_of(renderer))
    sent = to_vllm(scoped).get("multi_modal_uuids", {})
    assert sent == {
        modality: [f"stage0:rep{replica}:{key}" for key in keys]
        for modality, keys in expected.get("mm_hashes", {}).items()
    }
    return "rendered"


RENDERINGS: dict[str, st.SearchStrategy[Any]] = {
    "content_format": st.sampled_from(["string", "openai"]),
    "add_generation_prompt": st.booleans(),
    "replica": st.integers(0, 3),
}
"""What every generated corpus draws besides its conversation: ``@given(..., **RENDERINGS)``."""


def check_rendering(
    renderer: Any,
    messages: list[dict[str, Any]],
    content_format: str,
    add_generation_prompt: bool,
    replica: int,
) -> str:
    """:func:`check_parity` with the template and the options a corpus drew (``RENDERINGS``)."""
    options = {
        "chat_template": TEMPLATE,
        "chat_template_content_format": content_format,
        "add_generation_prompt": add_generation_prompt,
    }
    return check_parity(renderer, messages, replica, **options)
