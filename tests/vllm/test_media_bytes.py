"""vLLM's ``MediaWithBytes`` in records, ``from_vllm`` and ``MediaHasher``: keys equal vLLM's.

vLLM's loaders (``ImageMediaIO``, ``VideoMediaIO``, ``MediaConnector``) return media
wrapped with the encoded bytes, and vLLM keys such an item by those bytes and its
media-io config. These tests load real media with vLLM's own loaders and compare every
key with vLLM's hasher, including the cases of vLLM's own hasher tests
(``tests/multimodal/test_hasher.py``), and with the keys vLLM's renderer assigns.
"""

from __future__ import annotations

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import base64
import copy
import io
import pickle
import uuid
from typing import Any

import _tiny_models as tm
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media import ImageMediaIO, MediaConnector, MediaWithBytes
from vllm.multimodal.parse import MultiModalDataParser

from omni_requests import KeyPolicy, MediaHasher, PromptTypeError, TextPrompt, scope_to_replica
from omni_requests_vllm import from_vllm, to_vllm

pytestmark = pytest.mark.vllm

MODEL = "some/model"


def vllm_key(modality: str, item: object, algorithm: str = "blake3", model_id: str = MODEL) -> str:
    return MultiModalHasher.hash_kwargs(algorithm, model_id=model_id, **{modality: item})  # type: ignore[arg-type]


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def rgba_png() -> bytes:  # the image of vLLM's own media-io config tests
    return encoded(Image.new("RGBA", (8, 8), (255, 0, 0, 128)))


def parsed_video(item: object) -> object:
    """What vLLM's parser hands its hasher for one video item."""
    return MultiModalDataParser()._parse_video_data([item]).get_all_items_for_hash()[0]  # type: ignore[union-attr]


def metadata(num_frames: int) -> dict[str, Any]:
    return {
        "total_num_frames": 16,
        "fps": 2.0,
        "duration": 8.0,
        "video_backend": "opencv",
        "frames_indices": list(range(num_frames)),
        "do_sample_frames": False,
    }


# -- vLLM's own hasher tests, through MediaHasher and through records --


def test_media_io_config_cases_of_vllms_hasher_tests() -> None:
    data = rgba_png()
    white = ImageMediaIO(rgba_background_color=(255, 255, 255)).load_bytes(data)
    black = ImageMediaIO(rgba_background_color=(0, 0, 0)).load_bytes(data)
    white2 = ImageMediaIO(rgba_background_color=(255, 255, 255)).load_bytes(data)
    keep = ImageMediaIO(image_mode=None).load_bytes(data)
    hasher = MediaHasher(MODEL)
    items = {"white": white, "black": black, "white2": white2, "keep": keep}
    keys = {name: hasher.key("image", item) for name, item in items.items()}
    assert keys == {name: vllm_key("image", item) for name, item in items.items()}
    assert keys["white"] != keys["black"]
    assert keys["white"] != keys["keep"]
    assert keys["white"] == keys["white2"]


def test_a_noop_media_io_config_keeps_the_key_of_the_bytes() -> None:
    data = encoded(Image.new("RGB", (8, 8), (0, 128, 255)))
    loaded = ImageMediaIO().load_bytes(data)
    assert loaded.io_config is None
    plain = MediaWithBytes(loaded.media, data)
    hasher = MediaHasher(MODEL)
    assert hasher.key("image", loaded) == hasher.key("image", plain) == vllm_key("image", plain)
    # The bytes decide, not the pixels: the server's key for a file is not the decoded image's.
    assert hasher.key("image", loaded) != hasher.key("image", loaded.media)


def test_video_num_frames_case_of_vllms_hasher_tests() -> None:
    source = b"x" * 100
    hasher = MediaHasher(MODEL)
    keys = []
    for num_frames in (2, 4):
        video = MediaWithBytes((np.zeros((num_frames, 8, 8, 3), np.uint8), metadata(num_frames)), source)
        expected = vllm_key("video", parsed_video(video))
        assert hasher.key("video", video) == expected
        record = TextPrompt(prompt="<video>", multi_modal_data={"video": [video]})
        (item,) = record.multi_modal_data["video"]
        assert hasher.key("video", item) == expected
        assert vllm_key("video", parsed_video(to_vllm(record)["multi_modal_data"]["video"][0])) == expected
        keys.append(expected)
    assert keys[0] != keys[1]


@pytest.mark.parametrize("frames_bytes", [10, 1000])
def test_video_frames_smaller_than_their_bytes_are_keyed_by_the_frames(frames_bytes: int) -> None:
    frames = np.arange(frames_bytes, dtype=np.uint8).reshape(1, 1, -1, 1)
    video = MediaWithBytes(frames, b"y" * 100)
    assert MediaHasher(MODEL).key("video", video) == vllm_key("video", video)
    record = TextPrompt(prompt="<video>", multi_modal_data={"video": [video]})
    assert MediaHasher(MODEL).key("video", record.multi_modal_data["video"][0]) == vllm_key("video", video)


def test_an_exif_image_id_on_the_decoded_image_is_the_key() -> None:
    loaded = ImageMediaIO().load_bytes(rgba_png())
    loaded.media.getexif()[Image.ExifTags.Base.ImageID] = uuid.UUID(int=7)
    assert MediaHasher(MODEL).key("image", loaded) == vllm_key("image", loaded)
    assert vllm_key("image", loaded) == vllm_key("image", uuid.UUID(int=7).bytes)


@pytest.mark.parametrize("modality", ["image", "video", "caption"])
def test_loaded_images_sharing_an_image_id_get_their_own_content_keys_and_bindings(modality: str) -> None:
    # vLLM's hasher keys both by the ID alone, but the model sees their pixels: two inputs
    # (a deliberate divergence from vLLM's own key, docs/vllm-parity.md).
    # Fingerprints and content keys read the ID, so bind_content gave both one bound key
    # under a user's UUID, and outside image one content key.
    def loaded(shade: int) -> MediaWithBytes[Any]:
        item = ImageMediaIO().load_bytes(encoded(Image.new("RGB", (16, 16), (shade,) * 3)))
        item.media.getexif()[Image.ExifTags.Base.ImageID] = uuid.UUID(int=9)
        return item

    dark, light = loaded(0), loaded(255)
    assert vllm_key("image", dark) == vllm_key("image", light)  # vLLM's own key: the ID
    hasher = MediaHasher(MODEL)
    assert hasher.fingerprint(modality, dark) != hasher.fingerprint(modality, light)
    assert hasher.content_key(modality, dark) != hasher.content_key(modality, light)
    policy = KeyPolicy(bind_content=True)
    bound = {
        to_vllm(
            scope_to_replica(
                TextPrompt(
                    prompt="x", multi_modal_data={modality: [item]}, multi_modal_uuids={modality: ["u"]}
                ),
                0,
                hasher=hasher,
                policy=policy,
            )
        )["multi_modal_uuids"][modality][0]
        for item in (dark, light)
    }
    assert len(bound) == 2


# -- generated: images loaded by vLLM's own loader, every decode setting --

MODES = ("RGB", "RGBA", "L", "LA", "P", "1")


@st.composite
def loaded_images(draw: st.DrawFn) -> MediaWithBytes[Any]:
    mode = draw(st.sampled_from(MODES))
    size = (draw(st.integers(1, 12)), draw(st.integers(1, 12)))
    pixels = draw(st.binary(min_size=size[0] * size[1] * 4, max_size=size[0] * size[1] * 4))
    image = Image.frombytes("RGBA", size, pixels).convert(mode)
    fmt = draw(st.sampled_from(["PNG", "JPEG"] if mode in ("RGB", "L") else ["PNG"]))
    image_mode = draw(st.sampled_from([None, "RGB", "L", "RGBA"]))
    background = draw(st.tuples(*[st.integers(0, 255)] * 3))
    return ImageMediaIO(image_mode=image_mode, rgba_background_color=background).load_bytes(
        encoded(image, fmt)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loaded_images(), st.sampled_from(["blake3", "sha256", "sha512"]))
def test_loaded_images_keyed_like_vllm_in_records_and_from_vllm(
    item: MediaWithBytes[Any], algorithm: str
) -> None:
    expected = vllm_key("image", item, algorithm)
    hasher = MediaHasher(MODEL, algorithm)  # type: ignore[arg-type]
    assert hasher.key("image", item) == expected
    assert hasher.content_key("image", item) == expected  # vLLM's parser leaves it as it is
    record = from_vllm({"prompt": "<image>", "multi_modal_data": {"image": item}})
    (frozen,) = record.multi_modal_data["image"]
    assert isinstance(frozen, MediaWithBytes)  # vLLM still recognises the record's item
    assert vllm_key("image", frozen, algorithm) == expected
    assert hasher.key("image", frozen) == expected
    sent = to_vllm(record)["multi_modal_data"]["image"][0]
    assert vllm_key("image", sent, algorithm) == expected
    scoped = scope_to_replica(record, 1, hasher=hasher)
    assert to_vllm(scoped)["multi_modal_uuids"] == {"image": [f"stage0:rep1:{expected}"]}


# -- the record's copy is frozen, equal, picklable --


def test_the_records_copy_cannot_be_changed_and_survives_pickling() -> None:
    item = ImageMediaIO(rgba_background_color=(0, 0, 0)).load_bytes(rgba_png())
    record = TextPrompt(prompt="<image>", multi_modal_data={"image": item})
    (frozen,) = record.multi_modal_data["image"]
    for name, value in (("original_bytes", b""), ("io_config", None), ("media", None)):
        with pytest.raises(AttributeError, match="frozen"):
            setattr(frozen, name, value)
    config = frozen.io_config
    config["rgba_background_color"] = (1, 2, 3)  # a fresh dict each time: the record keeps its own
    assert frozen.io_config == item.io_config
    item.original_bytes = b"changed"  # the caller's object, not the record's
    assert frozen.original_bytes == rgba_png()
    again = pickle.loads(pickle.dumps(record))
    assert again == record
    assert MediaHasher(MODEL).key("image", again.multi_modal_data["image"][0]) == MediaHasher(MODEL).key(
        "image", frozen
    )
    assert "MediaWithBytes(Image(RGB, 8x8), " in repr(record)
    other = TextPrompt(prompt="<image>", multi_modal_data={"image": ImageMediaIO().load_bytes(rgba_png())})
    assert other != record  # same bytes, another io_config: another key


@pytest.mark.parametrize(
    "road",
    ["deepcopy", "copy", *(f"pickle-{p}" for p in range(pickle.HIGHEST_PROTOCOL + 1))],
)
def test_copies_and_pickles_keep_the_wrapper_its_frames_dtype_and_key(road: str) -> None:
    # vLLM's __getattr__ handed deepcopy the frames' own __deepcopy__ (the copy was a bare
    # array), and numpy's pickle below protocol 5 turned big-endian frames native.
    frames = np.arange(96, dtype=">i4").reshape(2, 4, 4, 3)
    record = TextPrompt(prompt="<video>", multi_modal_data={"video": MediaWithBytes(frames, b"x" * 100_000)})
    if road.startswith("pickle-"):
        again = pickle.loads(pickle.dumps(record, int(road.removeprefix("pickle-"))))
    else:
        again = getattr(copy, road)(record)
    (item,) = again.multi_modal_data["video"]
    assert isinstance(item, MediaWithBytes)
    assert item.media.dtype == np.dtype(">i4")
    assert again == record
    hasher = MediaHasher(MODEL)
    assert hasher.key("video", item) == hasher.key("video", record.multi_modal_data["video"][0])
    (frozen,) = record.multi_modal_data["video"]
    assert copy.deepcopy(frozen) is frozen and copy.copy(frozen) is frozen  # immutable


def test_media_vllm_cannot_key_is_refused_with_the_field() -> None:
    with pytest.raises(PromptTypeError, match=r"\$\.multi_modal_data\.audio\[0\]\.media"):
        from_vllm(
            {"prompt": "x", "multi_modal_data": {"audio": [MediaWithBytes((np.zeros(4), 16000.0), b"")]}}
        )
    with pytest.raises(PromptTypeError, match=r"\$\.multi_modal_data\.image\[0\]\.original_bytes"):
        TextPrompt(
            prompt="x", multi_modal_data={"image": MediaWithBytes(Image.new("RGB", (2, 2)), bytearray(3))}
        )


@pytest.mark.parametrize(
    ("modality", "item", "path"),
    [
        ("image", MediaWithBytes(Image.new("RGB", (4, 4)), b"PNG"), "$.multi_modal_data.image[0]"),
        (
            "video",
            MediaWithBytes((np.zeros((2, 4, 4, 3), np.uint8), {"fps": 2.0}), b"MP4"),
            "$.multi_modal_data.video[0][0]",  # stored as vLLM's parser splits it
        ),
    ],
    ids=["image", "video-with-metadata"],
)
def test_the_wire_format_refuses_it_by_name(modality: str, item: Any, path: str) -> None:
    # Its key is vLLM's hash of the encoded bytes, which no wire form of the decoded
    # item could give the receiver; the error named our private subclass and listed
    # the values that travel instead.
    pytest.importorskip("msgspec")
    from omni_requests.wire import encode

    record = TextPrompt(prompt=f"<{modality}>", multi_modal_data={modality: item})
    with pytest.raises(PromptTypeError, match=r"vLLM's MediaWithBytes .* has no wire form") as caught:
        encode(record)
    assert caught.value.path == path


# -- the engine's own keys and tokens --


def _data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_the_renderer_keys_and_processes_a_record_like_the_loaders_item(
    uncached_renderer: Any, qwen2_vl: Any
) -> None:
    renderer = uncached_renderer("qwen2_vl")
    connector = MediaConnector()
    image = connector.fetch_image(
        _data_url(encoded(Image.new("RGBA", (56, 56), (9, 99, 199, 100))), "image/png")
    )
    frames = ",".join(
        base64.b64encode(encoded(Image.new("RGB", (56, 56), (i * 40, 0, 0)), "JPEG")).decode()
        for i in range(4)
    )
    video = connector.fetch_video(f"data:video/jpeg;base64,{frames}")
    prompt = {
        "prompt": qwen2_vl.prompt(image=1, video=1),
        "multi_modal_data": {"image": [image], "video": [video]},
    }
    expected = tm.render(renderer, prompt)
    record = from_vllm(prompt)
    got = tm.render(renderer, to_vllm(record))
    assert got["prompt_token_ids"] == expected["prompt_token_ids"]
    assert tm.mm_hashes_of(got) == tm.mm_hashes_of(expected)
    hasher = MediaHasher(qwen2_vl.model_id)
    assert tm.mm_hashes_of(expected) == {
        "image": [hasher.key("image", image)],
        "video": [hasher.key("video", video)],
    }
    scoped = tm.render(renderer, to_vllm(scope_to_replica(record, 2, hasher=hasher)))
    assert tm.mm_hashes_of(scoped) == {
        m: [f"stage0:rep2:{k}" for k in v] for m, v in tm.mm_hashes_of(expected).items()
    }
