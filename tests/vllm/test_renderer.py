"""Records through vLLM's real renderer, for an image, an image+video and an audio model.

What this proves:

* Records never change vLLM's keys: ``to_vllm(record)`` renders to the same ``mm_hashes``
  as the plain dict the record was built from, for every item shape below.
* Scoped records: vLLM's ``mm_hashes`` are exactly the record's rendered keys,
  ``stage{S}:rep{R}:{base}``, for user UUIDs and content keys alike.
* Where ``MediaHasher.key(modality, item)`` on the record's item equals the key vLLM
  itself assigns (unscoped, no UUID). vLLM hashes the item *after* its parser ran
  (``MultiModalDataParser``), so the two are equal exactly when parsing keeps the item:

  ========================================  ==========================================  =====
  item as given                             what vLLM hashes                            equal
  ========================================  ==========================================  =====
  ndarray image (H, W, C), RGB PIL image    the item itself                             yes
  ndarray or tensor video (T, H, W, C)      the item itself                             yes
  1-d ndarray audio                         the item itself                             yes
  PIL image of another mode                 ``convert_image_mode(image, "RGB")``         no
  PIL image with EXIF Orientation           the image turned upright (exif_transpose)    no
  PIL image with ``info["transparency"]``   RGBA, then RGB on a white background         no
  PIL image with an in-memory EXIF ImageID  its pixels: the parser's copy drops the ID   no
  list of frames (arrays or PIL images)     ``np.array(frames)``                         no
  ``(frames, metadata)`` video              the frames alone, as given (a list stays a   no
                                            list), for models that take no metadata
                                            (Qwen2-VL); models that need it (Qwen2.5-VL)
                                            hash the tuple as given (read from vLLM's
                                            source; no tiny model here needs metadata)
  ``(audio, sr)`` at the model's rate       the bare array (``sr`` dropped)              no
  ``(audio, sr)`` at another rate           the array resampled to the model's rate      no
  list of floats (audio)                    ``np.array(list)``, float64                  no
  torch tensor (audio)                      ``tensor.numpy()``: hashed as an ndarray     no
  ========================================  ==========================================  =====

  In every case our hasher on the parsed item gives vLLM's key (checked below for each
  algorithm). A scoped record's base is the key of the item as given, like vllm-omni's:
  still bound to the content, only not equal to vLLM's unscoped key in the "no" rows.
* Mixed ``[uuid, None]`` lists, bare-string UUIDs, processor kwargs (vLLM then rehashes a
  UUID together with them) and cached-only ``None`` items behave as in vLLM.
"""

from __future__ import annotations

import pytest
from _tiny_models import VLLM_MISSING

pytest.importorskip("vllm", reason=VLLM_MISSING)

import uuid
from collections.abc import Callable
from typing import Any

import _tiny_models as tm
import numpy as np
import torch
from _engine import render
from _tiny_models import TinyModel
from PIL import Image
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.image import convert_image_mode, normalize_image

from omni_requests import (
    InvalidPromptError,
    MediaHasher,
    PromptTypeError,
    TextPrompt,
    media_keys,
    rendered_uuids,
    scope_to_replica,
)
from omni_requests_vllm import from_vllm, to_vllm

pytestmark = pytest.mark.vllm

ALGORITHMS = ("blake3", "sha256", "sha512")

_rng = np.random.default_rng(20260)


def _pixels(height: int = 28, width: int = 28) -> np.ndarray:
    return _rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def _frames(count: int = 2, side: int = 28) -> np.ndarray:
    return _rng.integers(0, 256, (count, side, side, 3), dtype=np.uint8)


def _wave(samples: int = 1600) -> np.ndarray:
    return _rng.standard_normal(samples).astype(np.float32)


def _pil(mode: str) -> Image.Image:
    return Image.fromarray(_pixels()).convert(mode)


def _with_exif(tag: int, value: object) -> Image.Image:
    image = Image.fromarray(_pixels(28, 56))
    image.getexif()[tag] = value
    return image


def _with_transparency() -> Image.Image:
    image = Image.fromarray(_pixels()).convert("P")
    image.info["transparency"] = 0
    return image


def _parsed_image(image: Image.Image) -> Image.Image:
    """What vLLM's image parser hands its hasher (vLLM's own functions)."""
    return convert_image_mode(normalize_image(image), "RGB")


def _stacked(frames: Any) -> np.ndarray:
    return np.array(frames)


Case = tuple[str, str, Callable[[], Any], Callable[[Any], Any] | None]
"""(model, modality, make the item, what vLLM hashes instead, or None for the item itself)."""

CASES: dict[str, Case] = {
    "image/ndarray/llava": ("llava", "image", _pixels, None),
    "image/ndarray/qwen2_vl": ("qwen2_vl", "image", lambda: _pixels(56, 28), None),
    "image/pil-RGB/llava": ("llava", "image", lambda: _pil("RGB"), None),
    "image/pil-RGB/qwen2_vl": ("qwen2_vl", "image", lambda: _pil("RGB"), None),
    **{
        f"image/pil-{mode}": ("qwen2_vl", "image", lambda mode=mode: _pil(mode), _parsed_image)
        for mode in ("L", "LA", "RGBA", "RGBX", "CMYK", "YCbCr", "P", "PA", "1", "I", "F")
    },
    "image/pil-exif-orientation": ("qwen2_vl", "image", lambda: _with_exif(0x0112, 6), _parsed_image),
    "image/pil-exif-image-id": ("llava", "image", lambda: _with_exif(0x800D, uuid.uuid4()), _parsed_image),
    "image/pil-transparency": ("llava", "image", _with_transparency, _parsed_image),
    "video/ndarray": ("qwen2_vl", "video", _frames, None),
    "video/tensor": ("qwen2_vl", "video", lambda: torch.from_numpy(_frames()), None),
    "video/list-of-arrays": ("qwen2_vl", "video", lambda: list(_frames()), _stacked),
    "video/list-of-pil": (
        "qwen2_vl",
        "video",
        lambda: [Image.fromarray(frame) for frame in _frames()],
        _stacked,
    ),
    "video/frames-with-metadata": (
        "qwen2_vl",
        "video",
        lambda: (_frames(4), {"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}),
        lambda item: item[0],
    ),
    "video/list-of-frames-with-metadata": (
        "qwen2_vl",
        "video",
        lambda: (list(_frames()), {"fps": 1.0}),
        lambda item: item[0],
    ),
    "audio/ndarray": ("qwen2_audio", "audio", _wave, None),
    "audio/tuple-at-model-rate": ("qwen2_audio", "audio", lambda: (_wave(), 16000), lambda item: item[0]),
    "audio/tuple-within-tolerance": (
        "qwen2_audio",
        "audio",
        lambda: (_wave(), 16000.0000001),
        lambda item: item[0],
    ),
    "audio/list-of-floats": (
        "qwen2_audio",
        "audio",
        lambda: [float(x) for x in _wave(400)],
        lambda item: np.array(item),
    ),
    "audio/tensor": ("qwen2_audio", "audio", lambda: torch.from_numpy(_wave()), lambda item: item.numpy()),
}


def _only_key(result: dict[str, Any], modality: str) -> str:
    (key,) = tm.mm_hashes_of(result)[modality]
    return key


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_where_our_content_key_equals_vllms_own(
    case: str, algorithm: str, tiny_models: dict[str, TinyModel], uncached_renderer: Any
) -> None:
    model_name, modality, make, parsed = CASES[case]
    model = tiny_models[model_name]
    renderer = uncached_renderer(model_name, mm_hasher_algorithm=algorithm)
    hasher = MediaHasher(model.model_id, algorithm)  # type: ignore[arg-type]
    item = make()
    prompt = model.prompt(**{modality: 1})
    record = TextPrompt(prompt=prompt, multi_modal_data={modality: item})

    vllm_key = _only_key(render(renderer, to_vllm(record)), modality)

    # The record does not change vLLM's key: the plain dict gets the same one.
    assert vllm_key == _only_key(
        render(renderer, {"prompt": prompt, "multi_modal_data": {modality: item}}), modality
    )
    # vLLM's key is our key of the item its parser made...
    what_vllm_hashes = item if parsed is None else parsed(item)
    assert vllm_key == hasher.key(modality, what_vllm_hashes)
    # ... and the record's content key is vLLM's when parsing keeps the item, and for every
    # PIL image (content_key hashes an image as vLLM's parser makes it, so images the model
    # sees differently never share a scoped key). Other items are hashed as given.
    (key,) = media_keys(record, hasher)[modality]
    assert key is not None
    assert key.base == hasher.content_key(modality, record.multi_modal_data[modality][0])
    assert (key.base == vllm_key) is (parsed is None or modality == "image")


def test_an_exif_image_id_is_the_key_only_for_direct_hasher_calls(
    llava: TinyModel, uncached_renderer: Any
) -> None:
    image_id = uuid.uuid4()
    image = _with_exif(0x800D, image_id)
    hasher = MediaHasher(llava.model_id)
    by_id = MultiModalHasher.hash_kwargs("blake3", model_id=llava.model_id, image=image)
    assert hasher.key("image", image) == by_id
    assert hasher.key("image", image) == hasher.key("image", _with_exif(0x800D, image_id))
    record = TextPrompt(prompt=llava.prompt(image=1), multi_modal_data={"image": image})
    vllm_key = _only_key(render(uncached_renderer("llava"), to_vllm(record)), "image")
    assert vllm_key != by_id
    assert vllm_key == hasher.key("image", Image.fromarray(np.asarray(image)))


def test_audio_at_another_rate_is_hashed_after_resampling(
    qwen2_audio: TinyModel, uncached_renderer: Any
) -> None:
    pytest.importorskip(
        "torchaudio",
        reason="vLLM resamples Qwen2-Audio input with torchaudio, which the CPU recipe lacks",
    )
    from vllm.multimodal.audio import AudioResampler

    wave = _wave(800)
    record = TextPrompt(prompt=qwen2_audio.prompt(audio=1), multi_modal_data={"audio": (wave, 8000)})
    vllm_key = _only_key(render(uncached_renderer("qwen2_audio"), to_vllm(record)), "audio")
    resampled = AudioResampler(target_sr=16000).resample(wave, orig_sr=8000)
    hasher = MediaHasher(qwen2_audio.model_id)
    assert vllm_key == hasher.key("audio", resampled)
    assert vllm_key != hasher.key("audio", record.multi_modal_data["audio"][0])


# -- scoped records: vLLM's keys are the record's rendered keys --


def _two_of_each(model: TinyModel) -> dict[str, list[Any]]:
    make = {"image": _pixels, "video": _frames, "audio": _wave}
    return {m: [make[m](), make[m]()] for m in model.modalities}


@pytest.mark.parametrize("model_name", ["llava", "qwen2_vl", "qwen2_audio"])
@pytest.mark.parametrize(("stage_id", "replica_id"), [(0, 0), (0, 1), (2, 7)])
def test_scoped_keys_are_the_keys_vllm_uses(
    model_name: str, stage_id: int, replica_id: int, tiny_models: dict[str, TinyModel], uncached_renderer: Any
) -> None:
    model = tiny_models[model_name]
    hasher = MediaHasher(model.model_id)
    data = _two_of_each(model)
    uuids = {m: [f"{m}-uuid", None] for m in data}
    record = TextPrompt(
        prompt=model.prompt(**{m: 2 for m in data}), multi_modal_data=data, multi_modal_uuids=uuids
    )
    scoped = scope_to_replica(record, replica_id, hasher=hasher, stage_id=stage_id)

    result = render(uncached_renderer(model_name), to_vllm(scoped))

    prefix = f"stage{stage_id}:rep{replica_id}:"
    expected = {
        m: [prefix + f"{m}-uuid", prefix + hasher.key(m, scoped.multi_modal_data[m][1])] for m in data
    }
    assert tm.mm_hashes_of(result) == expected == rendered_uuids(scoped)
    assert all(key.count("stage") == 1 for keys in expected.values() for key in keys)


def test_replicas_get_disjoint_keys_and_rescoping_never_stacks(
    qwen2_vl: TinyModel, uncached_renderer: Any
) -> None:
    hasher = MediaHasher(qwen2_vl.model_id)
    record = TextPrompt(
        prompt=qwen2_vl.prompt(image=1, video=1),
        multi_modal_data={"image": _pixels(), "video": _frames()},
        multi_modal_uuids={"image": "photo-1"},
    )
    renderer = uncached_renderer("qwen2_vl")
    on = {
        r: tm.mm_hashes_of(render(renderer, to_vllm(scope_to_replica(record, r, hasher=hasher))))
        for r in (0, 1)
    }
    flat = {r: {k for keys in on[r].values() for k in keys} for r in on}
    assert not flat[0] & flat[1]
    retried = scope_to_replica(scope_to_replica(record, 0, hasher=hasher), 1, hasher=hasher)
    assert tm.mm_hashes_of(render(renderer, to_vllm(retried))) == on[1]


# -- UUIDs as vLLM takes them --


def test_mixed_uuid_and_none_lists_behave_as_in_vllm(qwen2_vl: TinyModel, uncached_renderer: Any) -> None:
    images, video = [_pixels(), _pixels()], _frames()
    plain = {
        "prompt": qwen2_vl.prompt(image=2, video=1),
        "multi_modal_data": {"image": images, "video": video},
        "multi_modal_uuids": {"image": [None, "second"], "video": "clip"},
    }
    record = TextPrompt(**plain)
    renderer = uncached_renderer("qwen2_vl")
    from_record, from_dict = render(renderer, to_vllm(record)), render(renderer, plain)

    hasher = MediaHasher(qwen2_vl.model_id)
    assert tm.mm_hashes_of(from_record) == tm.mm_hashes_of(from_dict)
    assert tm.mm_hashes_of(from_record) == {
        "image": [hasher.key("image", images[0]), "second"],
        "video": ["clip"],
    }
    assert {m: [k.render() for k in keys if k] for m, keys in media_keys(record, hasher).items()} == (
        tm.mm_hashes_of(from_record)
    )
    assert from_record["mm_placeholders"] == from_dict["mm_placeholders"]


@pytest.mark.parametrize("count", [1, 3])
def test_a_tuple_of_videos_is_split_as_vllms_parser_splits_it(
    count: int, qwen2_vl: TinyModel, uncached_renderer: Any
) -> None:
    # vLLM reads a 2-tuple as one (frames, metadata) video and any other tuple as videos.
    videos = tuple(_frames() for _ in range(count))
    uuids = [f"clip-{i}" if i % 2 else None for i in range(count)]
    plain = {
        "prompt": qwen2_vl.prompt(video=count),
        "multi_modal_data": {"video": videos},
        "multi_modal_uuids": {"video": uuids},
    }
    record = from_vllm(plain)
    assert len(record.multi_modal_data["video"]) == count
    renderer = uncached_renderer("qwen2_vl")
    from_record, from_dict = render(renderer, to_vllm(record)), render(renderer, plain)
    hasher = MediaHasher(qwen2_vl.model_id)
    want = [uuid or hasher.key("video", video) for uuid, video in zip(uuids, videos, strict=True)]
    assert tm.mm_hashes_of(from_record) == tm.mm_hashes_of(from_dict) == {"video": want}
    assert from_record["mm_placeholders"] == from_dict["mm_placeholders"]


def test_a_one_frame_tuple_a_records_list_would_send_as_other_media_is_refused(
    qwen2_vl: TinyModel, uncached_renderer: Any
) -> None:
    # vLLM reads (frame,) as a tuple of one video whose array is the 3-D frame; a record
    # carries its items in a list, and vLLM reads a list of 3-D frames as one video of
    # those frames: other media to the model than the caller's dict.
    frame = _pixels()
    plain = {"prompt": qwen2_vl.prompt(video=1), "multi_modal_data": {"video": (frame,)}}
    given = render(uncached_renderer("qwen2_vl"), plain)
    listed = render(uncached_renderer("qwen2_vl"), {**plain, "multi_modal_data": {"video": [frame]}})
    assert tm.mm_hashes_of(given) != tm.mm_hashes_of(listed)
    with pytest.raises(PromptTypeError, match="frames of one video") as caught:
        from_vllm(plain)
    assert caught.value.path == "$.multi_modal_data.video"


def _image(mode: str, transparency: object = None) -> Image.Image:
    image = _pil(mode)
    if transparency is not None:
        image.info["transparency"] = transparency
    return image


# (mode, transparency): what vLLM's parser cannot turn into RGB, and near misses it can.
_UNPARSABLE = {
    "La": ("La", None),
    "L-float": ("L", 5.0),
    "L-bytes": ("L", b"\x00"),
    "RGB-four": ("RGB", (1, 2, 3, 4)),
    "RGB-float": ("RGB", 5.0),
    "P-tuple": ("P", (1, 2, 3)),
    "P-float": ("P", 5.0),
    "I-float": ("I", 5.0),
}
_PARSABLE = {
    "L-int": ("L", 3),
    "L-triple": ("L", (1, 2, 3)),
    "RGB-triple": ("RGB", (1, 2, 3)),
    "P-int": ("P", 3),
    "P-bytes": ("P", b"\x00\x10"),
    "RGBA-float": ("RGBA", 5.0),
}


@pytest.mark.parametrize("case", _UNPARSABLE.values(), ids=list(_UNPARSABLE))
def test_an_image_vllms_parser_cannot_turn_into_rgb_is_refused_when_built(
    case: tuple[str, object], qwen2_vl: TinyModel, uncached_renderer: Any
) -> None:
    # vLLM fails in its parser, after routing, even on a request with a user UUID (no
    # hash); a record refuses the image when built, naming it.
    mode, transparency = case
    image = _image(mode, transparency)
    plain = {
        "prompt": qwen2_vl.prompt(image=2),
        "multi_modal_data": {"image": [_pil("RGB"), image]},
        "multi_modal_uuids": {"image": ["a", "b"]},
    }
    with pytest.raises(Exception) as vllm_error:  # whatever Pillow raises in vLLM's parser
        render(uncached_renderer("qwen2_vl"), plain)
    for build in (
        lambda: from_vllm(plain),
        lambda: TextPrompt(prompt="x", multi_modal_data={"image": [image]}),
    ):
        with pytest.raises(InvalidPromptError, match=r"cannot turn this .* image into RGB") as caught:
            build()
        assert str(vllm_error.value) in caught.value.message  # Pillow's own reason, named
    assert caught.value.path == "$.multi_modal_data.image[0]"
    assert image.info.get("transparency") == transparency and image.mode == mode  # untouched


@pytest.mark.parametrize("case", _PARSABLE.values(), ids=list(_PARSABLE))
def test_images_vllms_parser_turns_into_rgb_are_taken_and_render_alike(
    case: tuple[str, object], qwen2_vl: TinyModel, uncached_renderer: Any
) -> None:
    image = _image(*case)
    plain = {"prompt": qwen2_vl.prompt(image=1), "multi_modal_data": {"image": image}}
    renderer = uncached_renderer("qwen2_vl")
    from_dict = render(renderer, plain)
    from_record = render(renderer, to_vllm(from_vllm(plain)))
    assert tm.mm_hashes_of(from_record) == tm.mm_hashes_of(from_dict)
    assert from_record["prompt_token_ids"] == from_dict["prompt_token_ids"]


@pytest.mark.parametrize("scoped", [False, True], ids=["unscoped", "scoped"])
def test_processor_kwargs_make_vllm_rehash_the_uuid_with_them(
    scoped: bool, qwen2_vl: TinyModel, uncached_renderer: Any
) -> None:
    hasher = MediaHasher(qwen2_vl.model_id)
    size = {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}
    kwargs = {"size": size, "images_kwargs": {"do_convert_rgb": True}}
    record = TextPrompt(
        prompt=qwen2_vl.prompt(image=1, video=1),
        multi_modal_data={"image": _pixels(56, 56), "video": _frames()},
        multi_modal_uuids={"image": ["img"], "video": [None]},
        mm_processor_kwargs=kwargs,
    )
    if scoped:
        record = scope_to_replica(record, 1, hasher=hasher)
    sent = to_vllm(record)
    result = render(uncached_renderer("qwen2_vl"), sent)

    # vLLM hashes the UUID it was sent with the kwargs that concern the modality:
    # flat ones for all, "images_kwargs" for images only.
    def rehashed(modality: str, value: object, concerning: dict[str, Any]) -> str:
        return MultiModalHasher.hash_kwargs(
            "blake3", model_id=qwen2_vl.model_id, **{modality: value}, mm_processor_kwargs=concerning
        )

    uuids = sent["multi_modal_uuids"]
    video = record.multi_modal_data["video"][0]
    video_kwargs = {"size": size}
    expected = {
        "image": [rehashed("image", uuids["image"][0], kwargs)],
        "video": [rehashed("video", uuids["video"][0] if scoped else video, video_kwargs)],
    }
    assert tm.mm_hashes_of(result) == expected
    if scoped:
        assert uuids == {"image": ["stage0:rep1:img"], "video": [f"stage0:rep1:{hasher.key('video', video)}"]}
        # Still one key per replica: the scope is inside what vLLM rehashes.
        other = render(uncached_renderer("qwen2_vl"), to_vllm(scope_to_replica(record, 0, hasher=hasher)))
        assert not set(tm.mm_hashes_of(other)["image"]) & set(expected["image"])
    else:
        plain = {
            **sent,
            "mm_processor_kwargs": {"size": dict(size), "images_kwargs": {"do_convert_rgb": True}},
        }
        assert tm.mm_hashes_of(render(uncached_renderer("qwen2_vl"), plain)) == expected


def test_a_cached_only_item_is_served_on_its_own_replica_only(
    qwen2_vl: TinyModel, fresh_renderer: Any
) -> None:
    renderer = fresh_renderer("qwen2_vl")  # one frontend, vLLM's default processor cache
    hasher = MediaHasher(qwen2_vl.model_id)
    prompt = qwen2_vl.prompt(video=1)
    first = TextPrompt(
        prompt=prompt, multi_modal_data={"video": _frames()}, multi_modal_uuids={"video": "clip-9"}
    )
    sent_first = render(renderer, to_vllm(scope_to_replica(first, 0, hasher=hasher)))

    # The same clip by UUID alone ("the engine has it"), to the same replica: served from cache.
    again = TextPrompt(
        prompt=prompt, multi_modal_data={"video": [None]}, multi_modal_uuids={"video": ["clip-9"]}
    )
    result = render(renderer, to_vllm(scope_to_replica(again, 0, hasher=hasher)))
    assert tm.mm_hashes_of(result) == {"video": ["stage0:rep0:clip-9"]}
    assert result["mm_placeholders"] == sent_first["mm_placeholders"]
    assert result["mm_kwargs"]["video"] == [None]  # the replica's own cache fills it in

    # To the other replica it is a miss, and vLLM refuses instead of serving rep0's copy.
    with pytest.raises(ValueError, match="Cache miss for video"):
        render(renderer, to_vllm(scope_to_replica(again, 1, hasher=hasher)))


# -- images the parser changes: the scoped base is the key of the image as vLLM parses it --


@pytest.mark.parametrize(
    "variant",
    [lambda image: _set_exif(image, 0x0112, 6), lambda image: _set_info(image, "transparency", 0)],
    ids=["exif-orientation", "transparency"],
)
def test_images_vllm_parses_differently_get_different_scoped_keys(
    variant: Callable[[Image.Image], Image.Image], qwen2_vl: TinyModel, fresh_renderer: Any
) -> None:
    renderer = fresh_renderer("qwen2_vl")
    hasher = MediaHasher(qwen2_vl.model_id)
    base = Image.fromarray(_pixels(28, 56)).convert("P")
    images = [base, variant(base.copy())]
    records = [TextPrompt(prompt=qwen2_vl.prompt(image=1), multi_modal_data={"image": im}) for im in images]
    # vLLM by itself keys them apart (it hashes them after turning and flattening them)...
    unscoped = [_only_key(render(renderer, to_vllm(r)), "image") for r in records]
    assert unscoped[0] != unscoped[1]
    # ... and so must the records scoped to one replica, or the second is served the
    # first's features from the sender cache.
    scoped = [
        _only_key(render(renderer, to_vllm(scope_to_replica(r, 0, hasher=hasher))), "image") for r in records
    ]
    assert scoped[0] != scoped[1]
    assert scoped == [f"stage0:rep0:{key}" for key in unscoped]  # the base is vLLM's own key


def _set_exif(image: Image.Image, tag: int, value: object) -> Image.Image:
    image.getexif()[tag] = value
    return image


def _set_info(image: Image.Image, name: str, value: object) -> Image.Image:
    image.info[name] = value
    return image


def test_audio_lists_vllms_parser_makes_other_arrays_of_get_other_scoped_keys(
    qwen2_audio: TinyModel, fresh_renderer: Any
) -> None:
    # vLLM's hasher hashes a Python number by its 8 bytes, untyped: the int whose bits are
    # a float's hashed as that float, and a list of such ints keyed as the float list.
    # vLLM's parser makes both lists arrays (ints as ints), other sounds to the model: one
    # scoped key over both, and the cached renderer served the floats' features for the
    # ints (found by a review, helper-83).
    renderer = fresh_renderer("qwen2_audio")  # one frontend, vLLM's default processor cache
    hasher = MediaHasher(qwen2_audio.model_id)
    floats = [float(x) for x in np.sin(np.linspace(0, 50, 1600))]
    bits = [int(np.array(x).view(np.int64)) for x in floats]
    records = [
        TextPrompt(prompt=qwen2_audio.prompt(audio=1), multi_modal_data={"audio": [wave]})
        for wave in (floats, bits)
    ]
    sent = [render(renderer, to_vllm(scope_to_replica(r, 1, hasher=hasher))) for r in records]
    keys = [_only_key(result, "audio") for result in sent]
    assert keys[0] != keys[1]
    features = [result["mm_kwargs"]["audio"][0] for result in sent]
    assert features[1] is not None  # processed anew, not served from the floats' entry
    assert not torch.equal(features[0].get_data()["input_features"], features[1].get_data()["input_features"])


def test_one_uuid_over_two_modalities_is_two_keys_where_vllm_hashes_it_with_their_options(
    qwen2_vl: TinyModel, fresh_renderer: Any
) -> None:
    # vLLM's chat parser names a video's audio with the video's UUID under
    # use_audio_in_video; records take one UUID over two modalities where the prompt's
    # options make vLLM hash it with each modality's name. An image and a video here (the
    # tiny Qwen2-VL takes no audio): vLLM keys them apart and renders each as itself.
    renderer = fresh_renderer("qwen2_vl")  # vLLM's default processor cache
    hasher = MediaHasher(qwen2_vl.model_id)
    data = {"image": [_pixels(28, 56)], "video": [_frames()]}
    record = TextPrompt(
        prompt=qwen2_vl.prompt(image=1, video=1),
        multi_modal_data=data,
        multi_modal_uuids={"image": ["clip-9"], "video": ["clip-9"]},
        mm_processor_kwargs={"use_audio_in_video": True},
    )
    for sent in (to_vllm(record), to_vllm(scope_to_replica(record, 1, hasher=hasher))):
        keys = tm.mm_hashes_of(render(renderer, sent))
        assert keys["image"] != keys["video"]
    # Each rendered as itself, as when sent alone (a cache shared by one key would not).
    both = render(fresh_renderer("qwen2_vl"), to_vllm(record))["mm_kwargs"]
    for modality, items in data.items():
        alone = {"prompt": qwen2_vl.prompt(**{modality: 1}), "multi_modal_data": {modality: items}}
        fields = render(fresh_renderer("qwen2_vl"), alone)["mm_kwargs"][modality][0].get_data()
        for name, value in fields.items():
            assert torch.equal(both[modality][0].get_data()[name], value), (modality, name)
    # Without such options vLLM takes the UUID as it is for both: one key, refused.
    with pytest.raises(InvalidPromptError, match="UUID 'clip-9' also names"):
        TextPrompt(
            prompt=qwen2_vl.prompt(image=1, video=1),
            multi_modal_data=data,
            multi_modal_uuids={"image": ["clip-9"], "video": ["clip-9"]},
        )
