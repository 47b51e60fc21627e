"""The chat path: messages with image, video and audio parts become records scoped like any prompt."""

from __future__ import annotations

import copy
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omni_requests import InvalidPromptError, MediaHasher, PromptTypeError, TextPrompt
from omni_requests_omni import (
    DefaultLoader,
    MediaLoadError,
    RemoteMediaError,
    RoundRobin,
    Stage0Pool,
    chat_to_prompt,
    decode_wav,
    scope_stage0,
)
from omni_requests_omni._loaders import read_under
from omni_requests_vllm import to_vllm

from ._helpers import (
    ProcessorCaches,
    b64,
    data_url,
    deep_equal,
    image_array,
    npy_bytes,
    png_bytes,
    tone,
    uuids_of,
    video_array,
    wav_bytes,
)

HASHER = MediaHasher("/models/tiny-omni")


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def _audio_part(seed: int, **extra: Any) -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": b64(wav_bytes(tone(seed))), "format": "wav"},
        **extra,
    }


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    (tmp_path / "cat.png").write_bytes(png_bytes(1))
    (tmp_path / "clip.npy").write_bytes(npy_bytes(video_array(2)))
    (tmp_path / "hello.wav").write_bytes(wav_bytes(tone(3)))
    return tmp_path


# -- loading -----------------------------------------------------------------------------


def test_data_urls_of_each_modality_load_into_items_in_order() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        *_user(
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(1))}},
            {"type": "video_url", "video_url": {"url": data_url("video/x-npy", npy_bytes(video_array(2)))}},
            _audio_part(3),
            {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(4))}},
        ),
    ]
    prompt = chat_to_prompt(messages)
    assert prompt.prompt == (
        # vLLM's order: the message's placeholders first, grouped by modality in the order
        # each first appears (vLLM keeps them per modality), then its text.
        "<|system|>\nBe brief.\n<|user|>\n<image>\n<image>\n<video>\n<audio>\nCompare\n<|assistant|>\n"
    )
    images = prompt.multi_modal_data["image"]
    assert [np.asarray(image).tolist() for image in images] == [
        image_array(1).tolist(),
        image_array(4).tolist(),
    ]
    # Decoded by vLLM's ImageMediaIO where vLLM is installed: the item keeps its PNG bytes.
    assert all(isinstance(image, Image.Image) or type(image).__name__ == "MediaWithBytes" for image in images)
    assert all(np.asarray(image).shape[-1] == 3 for image in images)
    (video,) = prompt.multi_modal_data["video"]
    assert deep_equal(np.asarray(video), video_array(2))
    ((samples, rate),) = prompt.multi_modal_data["audio"]
    assert rate == 16000.0 and samples.dtype == np.float32
    np.testing.assert_array_equal(samples, tone(3).astype(np.float32) / 32768)
    assert prompt.multi_modal_uuids == {}


def test_local_files_load_under_the_allowed_folder_only(media_dir: Path, tmp_path_factory: Any) -> None:
    loader = DefaultLoader(allowed_local_media_path=media_dir)
    prompt = chat_to_prompt(
        _user(
            {"type": "image_url", "image_url": {"url": (media_dir / "cat.png").as_uri()}},
            {"type": "video_url", "video_url": {"url": (media_dir / "clip.npy").as_uri()}},
            {"type": "audio_url", "audio_url": {"url": (media_dir / "hello.wav").as_uri()}},
        ),
        loader=loader,
    )
    assert np.asarray(prompt.multi_modal_data["image"][0]).tolist() == image_array(1).tolist()
    assert deep_equal(np.asarray(prompt.multi_modal_data["video"][0]), video_array(2))
    assert len(prompt.multi_modal_data["audio"][0][0]) == 400
    outside = tmp_path_factory.mktemp("elsewhere") / "x.png"
    outside.write_bytes(png_bytes(1))
    part = {"type": "image_url", "image_url": {"url": outside.as_uri()}}
    with pytest.raises(
        MediaLoadError,
        match=r"^\$\.messages\[0\]\.content\[0\]\.image_url: .*not under allowed_local_media_path",
    ):
        chat_to_prompt(_user(part), loader=loader)
    sneaky = {
        "type": "image_url",
        "image_url": {"url": (media_dir / ".." / outside.parent.name / "x.png").as_uri()},
    }
    with pytest.raises(MediaLoadError, match="not under allowed_local_media_path"):
        chat_to_prompt(_user(sneaky), loader=loader)
    with pytest.raises(MediaLoadError, match="cannot load local files without allowed_local_media_path"):
        chat_to_prompt(_user({"type": "image_url", "image_url": {"url": (media_dir / "cat.png").as_uri()}}))


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "HTTPS://example.com/a.wav"])
def test_remote_urls_are_out_of_scope_and_say_so(url: str) -> None:
    with pytest.raises(
        RemoteMediaError, match=r"^\$\.messages\[0\]\.content\[0\]\.image_url: remote URL .* out of scope"
    ):
        chat_to_prompt(_user({"type": "image_url", "image_url": {"url": url}}))


def test_a_custom_loader_can_take_over_any_url() -> None:
    seen: list[tuple[str, str]] = []

    def loader(modality: str, url: str) -> object:
        seen.append((modality, url))
        return image_array(9)

    prompt = chat_to_prompt(
        _user({"type": "image_url", "image_url": {"url": "https://cdn/cat.png"}}), loader=loader
    )
    assert seen == [("image", "https://cdn/cat.png")]
    assert deep_equal(np.asarray(prompt.multi_modal_data["image"][0]), image_array(9))


@pytest.mark.parametrize(
    ("part", "error", "message"),
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
            MediaLoadError,
            r"image_url: invalid base64",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png,raw"}},
            MediaLoadError,
            r"only base64 data URLs",
        ),
        (
            {"type": "image_url", "image_url": {"url": data_url("image/png", b"not a png")}},
            MediaLoadError,
            r"(not an image|Failed to load image)",
        ),
        (
            {"type": "image_url", "image_url": {"url": "/tmp/cat.png"}},
            MediaLoadError,
            r"unsupported media URL",
        ),
        (
            {"type": "video_url", "video_url": {"url": data_url("video/mp4", b"....")}},
            MediaLoadError,
            r"cannot decode (a video/mp4 video.*plug in a loader|the video)",
        ),
        (
            {"type": "video_url", "video_url": {"url": data_url("video/x-npy", npy_bytes(image_array(1)))}},
            MediaLoadError,
            r"4 dimensions",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": b64(b"ID3...."), "format": "mp3"}},
            MediaLoadError,
            r"cannot decode (audio/mp3 audio|the audio)",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": b64(b"RIFF...."), "format": "wav"}},
            MediaLoadError,
            r"input_audio: not a PCM WAV",
        ),
        ({"type": "image_url"}, PromptTypeError, r"image_url: must be an object with a 'url'"),
        ({"image_url": None}, InvalidPromptError, r"image_url: gives no media and no uuid"),
        ({"type": "image_url", "image_url": {"url": 3}}, PromptTypeError, r"image_url\.url: must be a str"),
        ({"image_url": {"url": 3}}, PromptTypeError, r"image_url: must be a URL str"),
        # Typed and without a uuid, vLLM validates the part against OpenAI's schema.
        (
            {"type": "video_url", "video_url": "https://x/v.mp4"},
            PromptTypeError,
            r"video_url: .*bare URL str",
        ),
        (
            {"type": "input_image", "image_url": "https://x/i.png"},
            InvalidPromptError,
            r"\.detail: must be one of",
        ),
        (
            {"type": "image_url", "image_url": {"url": "https://x/i.png", "detail": "max"}},
            InvalidPromptError,
            r"image_url\.detail: must be one of auto, low, high, original",
        ),
        (
            {"type": "image_url", "image_url": None, "uuid": ""},
            InvalidPromptError,
            r"\.uuid: must not be empty: every item needs its own key",
        ),
        ({"type": "file", "file": {}}, InvalidPromptError, r"\.type: unsupported content part 'file'"),
        ({"text": "no type"}, InvalidPromptError, r": a content part needs a 'type'"),
        # vLLM reads a part with a uuid by its media field, whatever its type: none, refused.
        ({"type": "text", "text": "a", "uuid": "u"}, InvalidPromptError, r"\.uuid: vLLM reads a part"),
        ({"type": "image_url", "uuid": "u"}, InvalidPromptError, r"\.uuid: .*gives its media field as null"),
        ({"type": "text", "text": 3}, PromptTypeError, r"\.text: must be a str, got int"),
    ],
)
def test_bad_parts_raise_with_the_path_of_the_part(
    part: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"^\$\.messages\[0\]\.content\[0\]" + ".*" + message):
        chat_to_prompt(_user(part))


@pytest.mark.parametrize(
    "part",
    [
        {"text": "no type"},
        {"type": "text", "text": "a", "uuid": "u"},
        {"type": "file", "file": {}},
        "<image> <image>",  # more placeholders than the message's one image
    ],
    ids=["no_type", "uuid_on_text", "unsupported", "too_many_placeholders"],
)
def test_a_bad_part_is_refused_before_any_media_is_loaded(part: object) -> None:
    # The refusal came after the parts before it were loaded (a large video, say).
    loaded: list[str] = []

    def loader(modality: str, url: str) -> object:
        loaded.append(modality)
        return image_array(1)

    image = {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(1))}}
    with pytest.raises(InvalidPromptError, match=r"^\$\.messages\[1\]\.content"):
        chat_to_prompt([*_user(image), *_user(image, part)], loader=loader)
    assert loaded == []


def test_an_int_uuid_too_long_for_text_and_placeholders_that_are_no_text_are_refused_by_name() -> None:
    # Python's ValueError (int-to-str past 4,300 digits) and TypeError escaped, naming no
    # field (found by an adversarial review).
    image = {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(1))}}
    with pytest.raises(InvalidPromptError, match="too long to read as text") as caught:
        chat_to_prompt([{"role": "user", "content": [{**image, "uuid": 10**5000}]}])
    assert caught.value.path == "$.messages[0].content[0].uuid"
    assert chat_to_prompt([{"role": "user", "content": [{**image, "uuid": 10**4000}]}]).multi_modal_uuids
    for placeholders, path in (({"image": 5}, "$.placeholders.image"), (["<image>"], "$.placeholders")):
        with pytest.raises(PromptTypeError) as caught:
            chat_to_prompt([{"role": "user", "content": [image]}], placeholders=placeholders)  # type: ignore[arg-type]
        assert caught.value.path == path


@pytest.mark.parametrize("uuid", ["stage0:rep1:cat", "tenant:acme:cat", "\ud800"])
def test_a_uuid_records_refuse_is_named_at_its_part(uuid: str) -> None:
    # The record's own checks (scoped, policy-shaped, not UTF-8) name $.multi_modal_uuids;
    # the chat names the part that gave the UUID, as the renderer road does.
    image = {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(1))}}
    messages = [
        {"role": "user", "content": [{**image, "uuid": "fine"}]},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {**image, "uuid": uuid}]},
    ]
    with pytest.raises(InvalidPromptError) as caught:
        chat_to_prompt(messages)
    assert caught.value.path == "$.messages[1].content[1]"


def test_bad_messages_raise_with_their_path() -> None:
    with pytest.raises(PromptTypeError, match=r"^\$\.messages: must be a list"):
        chat_to_prompt({"role": "user"})  # type: ignore[arg-type]
    with pytest.raises(InvalidPromptError, match=r"^\$\.messages\[1\]\.role: must be a non-empty str"):
        chat_to_prompt([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(
        PromptTypeError, match=r"^\$\.messages\[0\]\.content: must be a str or a list of parts, got int"
    ):
        chat_to_prompt([{"role": "user", "content": 3}])


def test_wav_decoding_handles_widths_and_channels() -> None:
    stereo = np.array([[100, -100], [32000, 0], [-32768, 32767]])
    samples, rate = decode_wav(wav_bytes(stereo.reshape(-1), 8000, channels=2))
    assert rate == 8000.0
    np.testing.assert_allclose(samples, stereo.mean(axis=1) / 32768, rtol=1e-6)
    eight, _ = decode_wav(wav_bytes(np.array([0, 128, 255]), width=1))
    np.testing.assert_allclose(eight, [-1.0, 0.0, 127 / 128])
    wide, _ = decode_wav(wav_bytes(np.array([-(1 << 31), 1 << 30]), width=4))
    np.testing.assert_allclose(wide, [-1.0, 0.5])
    assert not samples.flags.writeable  # frozen where made, so the hasher may cache its key


# -- uuids and scoping -------------------------------------------------------------------


def test_part_uuids_become_multi_modal_uuids_and_a_uuid_alone_is_a_cached_item() -> None:
    prompt = chat_to_prompt(
        _user(
            {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(1))}, "uuid": "cat"},
            {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(2))}},
            {"type": "image_url", "image_url": None, "uuid": "seen-before"},
            {"image_url": data_url("image/png", png_bytes(4)), "uuid": 44},  # str()-ed, as vLLM does
            _audio_part(3, uuid="clip-3"),
        )
    )
    assert prompt.multi_modal_uuids == {"image": ["cat", None, "seen-before", "44"], "audio": ["clip-3"]}
    assert prompt.multi_modal_data["image"][2] is None
    _, scoped = scope_stage0(prompt, pool=Stage0Pool(replicas=2, select=lambda _: 1), hasher=HASHER)
    image_key = HASHER.key("image", prompt.multi_modal_data["image"][1])
    assert uuids_of(scoped) == {
        "image": ["stage0:rep1:cat", f"stage0:rep1:{image_key}", "stage0:rep1:seen-before", "stage0:rep1:44"],
        "audio": ["stage0:rep1:clip-3"],
    }


def test_chat_media_is_keyed_exactly_like_the_same_media_in_a_plain_prompt() -> None:
    chat = chat_to_prompt(_user(_audio_part(5), {"type": "text", "text": "transcribe"}))
    samples, rate = decode_wav(wav_bytes(tone(5)))
    plain = {"prompt": "<audio> transcribe", "multi_modal_data": {"audio": (samples.copy(), rate)}}
    pool = Stage0Pool(replicas=2, select=lambda _: 0)
    _, chat_out = scope_stage0(chat, pool=pool, hasher=HASHER)
    _, plain_out = scope_stage0(plain, pool=pool, hasher=HASHER)
    assert (
        uuids_of(chat_out)
        == uuids_of(plain_out)
        == {"audio": ["stage0:rep0:" + HASHER.content_key("audio", (samples, rate))]}
    )


def test_a_repeated_audio_sent_through_chat_over_two_replicas_never_hits_another_replicas_cache() -> None:
    messages = _user(_audio_part(7), {"type": "text", "text": "what is said?"})
    pristine = copy.deepcopy(messages)
    pool = Stage0Pool(replicas=2, select=RoundRobin())
    scoped_caches, unscoped_caches = ProcessorCaches(), ProcessorCaches()
    replicas = []
    for _ in range(4):
        prompt = chat_to_prompt(messages)
        replica, scoped = scope_stage0(prompt, pool=pool, hasher=HASHER)
        assert replica is not None
        replicas.append(replica)
        sent = to_vllm(scoped)
        (key,) = sent["multi_modal_uuids"]["audio"]
        assert key.startswith(f"stage0:rep{replica}:")
        got = scoped_caches.send(replica, key, sent["multi_modal_data"]["audio"][0])
        assert got is not None and deep_equal(got[0], prompt.multi_modal_data["audio"][0][0])
        # What the chat path did before: media rendered before routing, keys left unscoped.
        unscoped_caches.send(replica, HASHER.key("audio", prompt.multi_modal_data["audio"][0]), object())
    assert replicas == [0, 1, 0, 1]
    assert scoped_caches.misses == []
    assert len(scoped_caches.sender) == 2  # one entry per replica, each a hit on its second use
    assert [replica for replica, _ in unscoped_caches.misses] == [1, 1]  # the bug: rep1 never gets it
    assert messages == pristine


def test_other_fields_go_to_the_record_and_templates_are_pluggable() -> None:
    prompt = chat_to_prompt(
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "video_url",
                        "video_url": {"url": data_url("video/x-npy", npy_bytes(video_array(1)))},
                    }
                ],
            },
            {"role": "assistant", "content": None},
        ],
        template=lambda turns: " | ".join(f"{t['role']}={t['content']}" for t in turns),
        placeholders={"video": "<|video_pad|>"},
        mm_processor_kwargs={"fps": 1},
        cache_salt="tenant-a",
    )
    assert isinstance(prompt, TextPrompt)
    assert prompt.prompt == "user=<|video_pad|> | assistant="
    assert prompt.mm_processor_kwargs == {"fps": 1} and prompt.cache_salt == "tenant-a"


def test_transparent_images_are_composited_over_white_like_vllm() -> None:
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (10, 20, 30, 255)  # opaque; the rest fully transparent black
    buffer = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buffer, format="PNG")
    prompt = chat_to_prompt(
        _user({"type": "image_url", "image_url": {"url": data_url("image/png", buffer.getvalue())}})
    )
    pixels = np.asarray(prompt.multi_modal_data["image"][0])
    assert pixels.shape == (2, 2, 3)
    assert pixels[0, 0].tolist() == [10, 20, 30] and pixels[1, 1].tolist() == [255, 255, 255]


# -- bad media: a clear error naming the part, in bounded time and memory ----------------


def _png_of_size(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("1", (width, height)).save(buffer, format="PNG")  # compresses to almost nothing
    return buffer.getvalue()


@pytest.mark.parametrize("use_vllm", [None, False])
def test_a_decompression_bomb_is_refused_before_decoding(use_vllm: bool | None) -> None:
    bomb = _png_of_size(20_000, 20_000)  # 400 M pixels in a few tens of KB
    assert len(bomb) < 100_000
    loader = DefaultLoader(use_vllm=use_vllm)
    with pytest.raises(
        MediaLoadError, match=r"^\$\.messages\[0\]\.content\[0\]\.image_url: the image (has|is too large)"
    ):
        chat_to_prompt(
            _user({"type": "image_url", "image_url": {"url": data_url("image/png", bomb)}}), loader=loader
        )
    small = DefaultLoader(max_pixels=100, use_vllm=use_vllm)
    with pytest.raises(
        MediaLoadError, match=r"image_url: the image has 20x20 = 400 pixels, more than max_pixels=100"
    ):
        chat_to_prompt(
            _user({"type": "image_url", "image_url": {"url": data_url("image/png", _png_of_size(20, 20))}}),
            loader=small,
        )


@pytest.mark.parametrize("use_vllm", [None, False])
def test_an_item_over_max_bytes_is_refused_from_a_data_url_and_a_file(
    use_vllm: bool | None, tmp_path: Path
) -> None:
    # DefaultLoader's max_bytes bounds one item's encoded size, before it is decoded.
    png = png_bytes(1, side=32)
    (tmp_path / "a.png").write_bytes(png)
    loader = DefaultLoader(max_bytes=len(png) - 1, use_vllm=use_vllm, allowed_local_media_path=tmp_path)
    for url, words in (
        (data_url("image/png", png), f"the media is larger than max_bytes={len(png) - 1}"),
        ((tmp_path / "a.png").as_uri(), f"the file has {len(png)} bytes, more than max_bytes={len(png) - 1}"),
    ):
        with pytest.raises(MediaLoadError, match=r"^\$\.messages\[0\]\.content\[0\]\.image_url: " + words):
            chat_to_prompt(_user({"type": "image_url", "image_url": {"url": url}}), loader=loader)
        fits = DefaultLoader(max_bytes=len(png), use_vllm=use_vllm, allowed_local_media_path=tmp_path)
        assert chat_to_prompt(_user({"type": "image_url", "image_url": {"url": url}}), loader=fits)


def test_a_file_url_holding_a_nul_byte_is_refused_by_name(tmp_path: Path) -> None:
    # Path.resolve raised ValueError ("embedded null byte") straight out of the loader.
    loader = DefaultLoader(allowed_local_media_path=tmp_path)
    with pytest.raises(MediaLoadError, match=r"^\$: cannot resolve .*embedded null byte"):
        loader("image", (tmp_path / "a").as_uri() + "%00b.png")


@pytest.mark.parametrize(
    ("kwargs", "path", "words"),
    [
        ({"max_bytes": "1"}, "max_bytes", "must be an int, got str"),
        ({"max_pixels": 0}, "max_pixels", "must be at least 1, got 0"),
        ({"max_bytes": True}, "max_bytes", "must be an int, got bool"),
        (
            {"allowed_local_media_path": 5},
            "allowed_local_media_path",
            "must be a str, a path or None, got int",
        ),
        ({"allowed_local_media_path": "a\0b"}, "allowed_local_media_path", "cannot resolve"),
        ({"image_mode": 1}, "image_mode", "must be a str or None, got int"),
        ({"use_vllm": "yes"}, "use_vllm", "must be a bool or None, got str"),
    ],
)
def test_loader_settings_are_checked_when_it_is_made(kwargs: dict[str, Any], path: str, words: str) -> None:
    # They failed inside the first load, with Python's own errors (found by an adversarial review).
    with pytest.raises((PromptTypeError, InvalidPromptError)) as caught:
        DefaultLoader(**kwargs)
    assert caught.value.path == path and words in str(caught.value)
    # numpy's ints and bools are taken (a limit read from a config array, say).
    DefaultLoader(max_bytes=np.int64(1 << 20), max_pixels=np.int32(1 << 20), use_vllm=np.bool_(False))


@pytest.mark.parametrize("limit", [np.int64(2**63 - 1), np.uint64(2**64 - 1), np.int8(127), np.uint8(255)])
def test_a_numpy_limit_at_its_dtypes_maximum_is_kept_as_an_int(
    media_dir: Path, limit: np.integer[Any]
) -> None:
    # Kept as numpy's int, the loader's size arithmetic overflowed: os.read got a negative
    # count (OSError escaped) or read nothing (found by a review, helper-58).
    loader = DefaultLoader(
        allowed_local_media_path=media_dir, max_bytes=limit, max_pixels=limit, use_vllm=np.bool_(False)
    )
    assert type(loader.max_bytes) is int and loader.max_bytes == int(limit)
    assert loader.use_vllm is False
    url = (media_dir / "cat.png").as_uri()
    if int(limit) < len((media_dir / "cat.png").read_bytes()):
        with pytest.raises(MediaLoadError, match="max_bytes"):
            loader("image", url)
    else:
        plain = DefaultLoader(allowed_local_media_path=media_dir, use_vllm=False)
        assert np.array_equal(np.asarray(loader("image", url)), np.asarray(plain("image", url)))


def test_decode_wav_refuses_what_is_no_bytes() -> None:
    with pytest.raises(PromptTypeError, match=r"^data: must be the WAV file's bytes, got str"):
        decode_wav("abc")  # type: ignore[arg-type]


def test_an_npy_header_declaring_more_than_its_bytes_is_refused() -> None:
    from numpy.lib import format as npy

    buffer = io.BytesIO()
    npy.write_array_header_1_0(buffer, {"descr": "|u1", "fortran_order": False, "shape": (1 << 40, 4, 4, 3)})
    enormous = buffer.getvalue() + bytes(64)
    with pytest.raises(
        MediaLoadError, match=r"video_url: the \.npy header declares shape .* but the data holds 64 bytes"
    ):
        chat_to_prompt(_user({"type": "video_url", "video_url": {"url": data_url("video/x-npy", enormous)}}))


def test_a_fifo_in_the_allowed_folder_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "clip.wav"
    os.mkfifo(fifo)
    loader = DefaultLoader(allowed_local_media_path=tmp_path)
    with pytest.raises(MediaLoadError, match=r"input_audio|audio_url: .*not a regular file"):
        chat_to_prompt(_user({"type": "audio_url", "audio_url": {"url": fifo.as_uri()}}), loader=loader)


def test_a_symlink_swapped_in_after_the_check_is_refused(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(png_bytes(1))
    checked = allowed / "cat.png"  # checked while it was a plain file under the folder ...
    checked.write_bytes(png_bytes(2))
    assert read_under(allowed.resolve(), checked.resolve(), 1 << 20) == png_bytes(2)
    checked.unlink()  # ... then swapped for a link out of it before the read
    checked.symlink_to(outside / "secret.png")
    with pytest.raises(MediaLoadError, match="cannot open"):
        read_under(allowed.resolve(), checked, 1 << 20)
    # A folder on the way swapped for a link: caught by where the opened file really is.
    (allowed / "sub").symlink_to(outside)
    with pytest.raises(MediaLoadError, match="outside allowed_local_media_path when opened"):
        read_under(allowed.resolve(), allowed.resolve() / "sub" / "secret.png", 1 << 20)
    # And through the loader, a link out of the folder never passes the check.
    loader = DefaultLoader(allowed_local_media_path=allowed)
    with pytest.raises(MediaLoadError, match=r"image_url: the file .* is not under allowed_local_media_path"):
        chat_to_prompt(_user({"type": "image_url", "image_url": {"url": checked.as_uri()}}), loader=loader)


def test_the_fallback_decodes_images_to_vllms_pixels() -> None:
    vllm_media = pytest.importorskip("vllm.multimodal.media")
    for seed in range(3):
        for mode in ("RGB", "RGBA", "P", "L"):
            buffer = io.BytesIO()
            Image.fromarray(image_array(seed)).convert(mode).save(buffer, format="PNG")
            data = buffer.getvalue()
            ours = DefaultLoader(use_vllm=False)("image", data_url("image/png", data))
            theirs = vllm_media.ImageMediaIO().load_bytes(data)
            assert np.asarray(ours).tobytes() == np.asarray(theirs.media).tobytes()


# -- the stand-in's parts, and what it leaves to vLLM -------------------------------------


def test_the_stand_in_reads_text_like_parts_as_vllm_does_and_puts_placeholders_first() -> None:
    prompt = chat_to_prompt(
        _user(
            {"type": "input_text", "text": "one"},
            {"type": "input_image", "image_url": data_url("image/png", png_bytes(1)), "detail": "auto"},
            {"type": "refusal", "refusal": "two"},
            {"type": "thinking", "thinking": "three"},
            {"type": "text", "text": None},  # vLLM skips a part without content
            "four",
        )
    )
    assert prompt.prompt == "<|user|>\n<image>\none\ntwo\nthree\nfour\n<|assistant|>\n"
    assert np.asarray(prompt.multi_modal_data["image"][0]).tolist() == image_array(1).tolist()


@pytest.mark.parametrize(
    ("texts", "items"),
    [
        (["what is <image> here", ""], 1),  # the text holds the placeholder: none added
        (["<image> and", "", "more"], 2),  # one of two held: one added, empty part dropped
        (["", ""], 2),
        (["a <audio> b"], 1),  # another modality's placeholder is text to an image
    ],
)
def test_the_stand_in_adds_only_missing_placeholders_and_drops_empty_text_as_vllm_does(
    texts: list[str], items: int
) -> None:
    # It prepended one placeholder per item even where the text held it already (the
    # model then saw two for one image) and kept empty text parts as blank lines.
    parts: list[Any] = [
        *(
            {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(i))}}
            for i in range(items)
        ),
        *texts,
    ]
    prompt = chat_to_prompt([{"role": "user", "content": parts}])
    # vLLM's own rule: its parser drops falsy parts, then combines (interleaving off).
    chat_message = pytest.importorskip("vllm.renderers.chat_utils.chat_message")
    content = chat_message.get_full_multimodal_text_prompt(
        {"image": ["<image>"] * items}, [t for t in texts if t], interleave_strings=False
    )
    assert prompt.prompt == f"<|user|>\n{content}\n<|assistant|>\n"
    assert content.count("<image>") == items


def test_an_empty_placeholder_adds_nothing_as_in_vllm() -> None:
    # vLLM's parser skips a falsy placeholder (a model whose processor places its own
    # tokens); the stand-in counted "" in the text, so every such message was refused.
    image = {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(1))}}
    prompt = chat_to_prompt(_user(image, image, "describe"), placeholders={"image": ""})
    assert prompt.prompt == "<|user|>\ndescribe\n<|assistant|>\n"
    assert len(prompt.multi_modal_data["image"]) == 2
    assert chat_to_prompt(_user(image), placeholders={"image": ""}).prompt == "<|user|>\n\n<|assistant|>\n"


def test_the_stand_in_refuses_more_placeholders_than_items_by_name() -> None:
    with pytest.raises(
        InvalidPromptError, match=r"^\$\.messages\[0\]\.content: .*more '<image>' placeholders"
    ):
        chat_to_prompt(
            _user(
                {"type": "image_url", "image_url": {"url": data_url("image/png", png_bytes(1))}},
                "<image> <image>",
            )
        )


@pytest.mark.parametrize(
    ("message", "path"),
    [
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            "tool_calls",
        ),
        ({"role": "tool", "tool_call_id": "c", "content": "42"}, "tool_call_id"),
        ({"role": "user", "name": "ada", "content": "hi"}, "name"),
    ],
)
def test_the_stand_in_refuses_what_its_flat_turns_would_drop(message: dict[str, Any], path: str) -> None:
    with pytest.raises(InvalidPromptError, match=rf"^\$\.messages\[1\]\.{path}: .*pass renderer="):
        chat_to_prompt([{"role": "system", "content": "s"}, message])


def test_stand_in_options_with_a_renderer_and_a_non_renderer_are_refused() -> None:
    with pytest.raises(InvalidPromptError, match=r"^\$\.template: is for the stand-in"):
        chat_to_prompt(_user({"type": "text", "text": "a"}), renderer=object(), template=lambda turns: "")
    with pytest.raises(PromptTypeError, match=r"^\$\.renderer: must be a vLLM renderer"):
        chat_to_prompt(_user({"type": "text", "text": "a"}), renderer=object())


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"template": 5}, r"^\$\.template: must be callable, got int"),
        ({"template": None}, r"^\$\.template: must be callable, got None"),
        ({"loader": 5}, r"^\$\.loader: must be callable or None, got int"),
        ({"foo": 1}, r"^\$\.foo: is neither an option of chat_to_prompt nor a TextPrompt field"),
    ],
)
def test_the_stand_ins_arguments_are_checked_before_any_media_is_loaded(
    given: dict[str, Any], message: str
) -> None:
    # Each failed only after loading every item: a bare TypeError, the last naming the record.
    loaded: list[str] = []

    def loader(modality: str, url: str) -> object:
        loaded.append(url)
        return np.zeros((2, 2, 3), np.uint8)

    messages = _user({"type": "image_url", "image_url": {"url": "file:///cat.png"}})
    with pytest.raises(PromptTypeError, match=message):
        chat_to_prompt(messages, **{"loader": loader, **given})
    assert loaded == []
    assert chat_to_prompt(messages, loader=loader, cache_salt="s").cache_salt == "s"


@pytest.mark.parametrize("field", ["prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids"])
@pytest.mark.parametrize("renderer", [None, object()], ids=["stand-in", "vllm"])
def test_a_keyword_never_replaces_what_the_chat_renders(field: str, renderer: object) -> None:
    # With a renderer, such a keyword silently replaced vLLM's rendered tokens, media or
    # per-part UUIDs; the stand-in raised a bare TypeError.
    with pytest.raises(InvalidPromptError, match=rf"^\$\.{field}: is what the chat renders"):
        chat_to_prompt(_user({"type": "text", "text": "a"}), renderer=renderer, **{field: ["x"]})
