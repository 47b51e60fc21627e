"""omni_requests.strategies: what they generate, how they shrink, and how they refuse bad arguments."""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from PIL import Image

from omni_requests import (
    EmbedsPrompt,
    EncoderDecoderPrompt,
    MediaHasher,
    TextPrompt,
    TokensPrompt,
    media_keys,
)
from omni_requests import strategies as S

FEW = settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def seen(
    strategy: st.SearchStrategy[Any], feature: Callable[[Any], object], examples: int = 150
) -> set[object]:
    """The values of ``feature`` over many drawn examples."""
    found: set[object] = set()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # coverage checks must not flake
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: Any) -> None:
        found.add(feature(value))

    collect()
    return found


# -- coverage: every mode, dtype, layout and form turns up ------------------------------------


def test_images_cover_every_mode_palettes_and_exif_ids() -> None:
    assert seen(S.images(), lambda im: im.mode, 300) == set(S.IMAGE_MODES)

    def exif(image: Image.Image) -> str:
        value = image.getexif().get(0x800D)
        return type(value).__name__

    assert seen(S.images(), exif) == {"NoneType", "UUID", "str"}
    palettes = seen(S.images(modes=["P", "PA"]), lambda im: im.palette.mode)
    assert palettes == {"RGB", "RGBA"}
    assert seen(S.images(exif_image_ids=False), exif) == {"NoneType"}


def test_arrays_cover_dtypes_layouts_and_zero_dims() -> None:
    # 250 examples missed bool after the demo test had run: Hypothesis mixes constants
    # from the modules loaded so far into its draws, so even derandomized draws follow
    # test order. 500 leaves a margin.
    assert seen(S.arrays(), lambda a: a.dtype.str, 500) == {np.dtype(d).str for d in S.ARRAY_DTYPES}
    assert seen(S.arrays(), lambda a: (a.ndim == 0, a.flags.c_contiguous)) == {
        (True, True),
        (False, True),
        (False, False),
    }
    assert seen(S.arrays(), lambda a: any(s < 0 for s in a.strides)) == {True, False}
    assert seen(S.arrays(non_contiguous=False), lambda a: a.flags.c_contiguous) == {True}


def test_tensors_cover_bfloat16_and_non_contiguous() -> None:
    dtypes = seen(S.tensors(), lambda t: str(t.dtype).removeprefix("torch."), 200)
    assert dtypes == set(S.TENSOR_DTYPES)
    assert seen(S.tensors(min_dims=2), lambda t: t.is_contiguous()) == {True, False}
    assert seen(S.tensors(dtypes=[torch.float16]), lambda t: t.dtype) == {torch.float16}


def test_tensors_are_drawn_on_the_cpu_whatever_the_default_device() -> None:
    # A strided tensor's base followed torch's default device: under "meta" records
    # refused such draws, and on a GPU server they came out on the GPU (helper-90).
    torch.set_default_device("meta")
    try:
        devices = seen(S.tensors(min_dims=1), lambda t: t.device.type, 100)
    finally:
        torch.set_default_device(None)
    assert devices == {"cpu"}


def test_videos_and_audios_cover_every_form() -> None:
    def video_form(v: Any) -> str:
        if isinstance(v, tuple):
            return "with_metadata"
        if isinstance(v, np.ndarray):
            return f"array{v.ndim}"
        return "images" if isinstance(v[0], Image.Image) else f"frames{v[0].ndim}"

    assert seen(S.videos(), video_form) == {"with_metadata", "array4", "images", "frames3"}

    def audio_form(a: Any) -> str:
        if isinstance(a, tuple):
            return f"tuple({a[0].dtype}, {type(a[1]).__name__})"
        return f"array{a.ndim}" if isinstance(a, np.ndarray) else "list"

    assert seen(S.audios(), audio_form) == {"tuple(float32, int)", "tuple(float64, int)", "array1", "list"}


@pytest.mark.parametrize("modality", S.MODALITIES)
@FEW
@given(data=st.data())
def test_media_items_are_one_item_of_their_modality(modality: str, data: st.DataObject) -> None:
    item = data.draw(S.media_items(modality, embeddings=True))
    p = TextPrompt(prompt="", multi_modal_data={modality: [item]})
    assert len(p.multi_modal_data[modality]) == 1


# -- records ---------------------------------------------------------------------------------


@FEW
@given(S.prompts(kinds=S.PROMPT_KINDS, embeddings=True))
def test_prompts_are_valid_records_of_every_kind(prompt: Any) -> None:
    assert isinstance(prompt, (TextPrompt, TokensPrompt, EmbedsPrompt, EncoderDecoderPrompt))


def test_prompts_have_uuids_none_items_cached_only_modalities_and_omni_fields() -> None:
    def features(p: Any) -> frozenset[str]:
        found = set()
        if p.multi_modal_uuids:
            found.add("uuids")
        if any(item is None for items in p.multi_modal_data.values() for item in items):
            found.add("none item")
        if set(p.multi_modal_uuids) - set(p.multi_modal_data):
            found.add("cached-only modality")
        if getattr(p, "negative_prompt", None) is not None:
            found.add("negative_prompt")
        if p.additional_information is not None:
            found.add("additional_information")
        if not p.multi_modal_data:
            found.add("no media")
        return frozenset(found)

    union = set().union(*seen(S.text_prompts(), features, 200))
    assert union == {
        "uuids",
        "none item",
        "cached-only modality",
        "negative_prompt",
        "additional_information",
        "no media",
    }
    plain = seen(S.text_prompts(media=True, user_uuids=False, none_items=False, omni_fields=False), features)
    assert plain == {frozenset()}
    omni = {"negative_prompt", "additional_information"}
    assert {f - omni for f in seen(S.tokens_prompts(media=False), features)} == {frozenset({"no media"})}


@FEW
@given(data=st.data(), new_uuids=st.booleans())
def test_copies_carry_new_distinct_media_and_nothing_else_changes(
    data: st.DataObject, new_uuids: bool
) -> None:
    hasher = MediaHasher("m")
    template, copies = data.draw(S.templates_with_copies(new_uuids=new_uuids))
    assert 1 <= len(copies) <= 3
    kept = set() if new_uuids else {u for row in template.multi_modal_uuids.values() for u in row if u}
    kept |= _cached_only(template)
    bases = [set(_bases(template, hasher))] + [set(_bases(c, hasher)) for c in copies]
    for i, mine in enumerate(bases):
        for other in bases[i + 1 :]:
            assert not (mine & other) - kept
    for c in copies:
        assert c.multi_modal_data.keys() == template.multi_modal_data.keys()
        if not new_uuids:
            assert c.multi_modal_uuids == template.multi_modal_uuids  # a copy changes its media only
        for name in ("prompt", "cache_salt", "additional_information"):
            assert getattr(c, name, None) == getattr(template, name, None)


def _bases(prompt: Any, hasher: MediaHasher) -> list[str]:
    return [k.base for row in media_keys(prompt, hasher).values() for k in row if k is not None]


def _cached_only(prompt: Any) -> set[str]:
    return {
        u
        for m, given in prompt.multi_modal_uuids.items()
        if m not in prompt.multi_modal_data
        for u in given
        if u
    }


@FEW
@given(S.replica_layouts(min_replicas=2, max_replicas=3, max_stage_id=1))
def test_replica_layouts_choose_existing_replicas(layout: S.ReplicaLayout) -> None:
    assert 2 <= layout.replicas <= 3 and 0 <= layout.stage_id <= 1
    assert all(0 <= r < layout.replicas for r in layout.choices)


def test_hashers_cover_the_three_algorithms() -> None:
    assert seen(S.hashers(), lambda h: h.algorithm) == {"blake3", "sha256", "sha512"}
    assert seen(S.hashers(algorithms=["sha256"]), lambda h: h.algorithm) == {"sha256"}


# -- shrinking: failing tests show small, readable media -----------------------------------------


def test_examples_shrink_to_tiny_media() -> None:
    image = find(S.images(), lambda im: True)
    assert (image.mode, image.size, image.tobytes()) == ("RGB", (1, 1), b"\0\0\0")
    assert find(S.images(), lambda im: im.mode == "P").size == (1, 1)
    assert find(S.arrays(), lambda a: a.ndim >= 2).shape == (1, 1)
    video = find(S.videos(), lambda v: True)
    frames = [video] if isinstance(video, np.ndarray) else video
    assert sum(np.asarray(frame).size for frame in frames) <= 9  # a frame of at most 3 RGB pixels
    assert find(S.audios(), lambda a: True) == [0.0]


# -- argument validation ----------------------------------------------------------------------------

BAD_ARGUMENTS = [
    (lambda: S.images(min_side=4, max_side=2), "max_side=2 must be >= min_side=4"),
    (lambda: S.images(min_side=0), "min_side=0 must be >= 1"),
    (lambda: S.images(modes=["RGB", "XYZ"]), "modes contains 'XYZ'"),
    (lambda: S.images(modes=[]), "modes must not be empty"),
    (lambda: S.images(modes="RGB"), "modes='RGB' must be a list"),
    (lambda: S.images(palettes=1), "palettes=1 must be a bool"),
    (lambda: S.arrays(dtypes=["object"]), "must be bool or numeric"),
    (lambda: S.arrays(dtypes=["nope"]), "'nope', which is not a numpy dtype"),
    (lambda: S.arrays(max_dims=-1), "max_dims=-1 must be >= 0"),
    (lambda: S.arrays(min_dims=3, max_dims=2), "max_dims=2 must be >= min_dims=3"),
    (lambda: S.arrays(max_side=2.5), "max_side=2.5 must be an int, got float"),
    (lambda: S.tensors(dtypes=["float8_e4m3fn"]), "dtypes contains 'float8_e4m3fn'"),
    (lambda: S.videos(max_frames=0), "max_frames=0 must be >= 1"),
    (lambda: S.audios(sample_rates=[]), "sample_rates must not be empty"),
    (lambda: S.media_items("text"), "modality='text'"),
    (lambda: S.multi_modal_data(min_modalities=4), "min_modalities=4 must be <= 3"),
    (lambda: S.text_prompts(user_uuids=False), "none_items=True needs user_uuids=True"),
    (lambda: S.text_prompts(media="yes"), "media='yes' must be True, False or None"),
    (lambda: S.text_prompts(text="hello"), "text='hello' must be a Hypothesis strategy"),
    (lambda: S.tokens_prompts(max_tokens=0), "max_tokens=0 must be >= 1"),
    (lambda: S.prompts(kinds=["text", "chat"]), "kinds contains 'chat'"),
    (lambda: S.templates_with_copies(min_copies=2, max_copies=1), "max_copies=1 must be >= min_copies=2"),
    (lambda: S.templates_with_copies(prompts=[1]), "prompts=[1] must be a Hypothesis strategy"),
    (lambda: S.replica_layouts(min_replicas=0), "min_replicas=0 must be >= 1"),
    (lambda: S.hashers(algorithms=["md5"]), "algorithms contains 'md5'"),
]


@pytest.mark.parametrize(("make", "message"), BAD_ARGUMENTS)
def test_bad_arguments_raise_invalid_argument_naming_them(make: Callable[[], object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        make()


def test_missing_optional_dependencies_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def without(*names: str) -> Callable[[str], object]:
        return lambda name, *args: None if name in names else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without("torch"))
    with pytest.raises(ModuleNotFoundError, match=r"tensors\(\) needs torch.*omni-requests\[torch\]"):
        S.tensors()
    with pytest.raises(ModuleNotFoundError, match="needs torch"):
        S.embeds_prompts()
    S.prompts()  # without torch the default kinds leave "embeds" out
    monkeypatch.setattr(importlib.util, "find_spec", without("PIL"))
    with pytest.raises(ModuleNotFoundError, match=r"images\(\) needs PIL.*omni-requests\[images\]"):
        S.images()


def test_core_does_not_import_hypothesis() -> None:
    import subprocess
    import sys

    code = "import sys, omni_requests; assert 'hypothesis' not in sys.modules, 'core imported hypothesis'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- st.from_type through the entry point's function ---------------------------------------------------


@pytest.mark.parametrize("kind", [TextPrompt, TokensPrompt, EmbedsPrompt, MediaHasher])
def test_registration_makes_from_type_give_our_records(kind: type) -> None:
    from omni_requests import _hypothesis_hook

    _hypothesis_hook.register()
    assert seen(st.from_type(kind), type, 10) == {kind}


@pytest.mark.parametrize(
    "code",
    [
        "import omni_requests.strategies",
        "from omni_requests import strategies",
        "import omni_requests.testing",
        # Hypothesis first, then ours: the entry point ran before our modules existed.
        "import hypothesis.strategies as st; from omni_requests import TextPrompt;"
        " assert type(st.from_type(TextPrompt).example()) is TextPrompt",
        # Ours first: Hypothesis is imported, and its entry point run, from inside strategies.
        "from omni_requests import strategies, TextPrompt, MediaHasher; import hypothesis.strategies as st;"
        " assert type(st.from_type(TextPrompt).example()) is TextPrompt;"
        " assert type(st.from_type(MediaHasher).example()) is MediaHasher",
    ],
)
def test_strategies_import_in_a_bare_interpreter(code: str) -> None:
    # Under pytest Hypothesis is imported before any test module, which hid a circular
    # import: the entry point named a function of the module that imports Hypothesis.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_NO_PLUGINS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_entry_point_names_a_module_that_does_not_import_hypothesis() -> None:
    import importlib.metadata
    import subprocess
    import sys

    (entry,) = [e for e in importlib.metadata.entry_points(group="hypothesis") if e.name == "omni_requests"]
    code = f"import sys, {entry.module}; assert 'hypothesis' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_exif_image_id_decides_the_key_of_an_image() -> None:
    # The strategies put a UUID at tag 0x800D because vLLM keys such an image by it alone.
    hasher = MediaHasher("m")
    a, b = Image.new("RGB", (1, 1)), Image.new("RGB", (2, 1), (9, 9, 9))
    for image in (a, b):
        image.getexif()[0x800D] = uuid.UUID(int=7)
    assert hasher.key("image", a) == hasher.key("image", b)


# -- media_identity: an oracle for "equal media", independent of MediaHasher ----------------------


def _tagged_frames(gray: int) -> list[Image.Image]:
    frames = [Image.new("RGB", (3, 2), (gray, gray, gray)) for _ in range(2)]
    for frame in frames:
        frame.getexif()[0x800D] = uuid.UUID(int=1)
    return frames


def test_media_identity_reads_video_frames_by_pixels_as_the_model_sees_them() -> None:
    # vLLM's hasher keys a bare PIL frame by its ImageID, but its parser stacks a video's
    # frames into one array, the ID gone: as the model sees them, these videos differ.
    black, white = _tagged_frames(0), _tagged_frames(255)
    assert S.media_identity("video", black) == S.media_identity("video", white)
    assert S.media_identity("video", black, parsed=True) != S.media_identity("video", white, parsed=True)
    # Under image, vLLM's parser drops the ID as well (its turned copy), read as it turns it.
    assert S.media_identity("image", black[0], parsed=True) != S.media_identity(
        "image", white[0], parsed=True
    )
    # A list of images as one image item is kept as it is, for the model to read: by pixels
    # too (the oracle read it by the IDs, agreeing with the keys it should check; helper-80).
    assert S.media_identity("image", black, parsed=True) != S.media_identity("image", white, parsed=True)
    black[0].info["transparency"] = (0, 0, 0)  # a processor composites it: other pixels
    assert S.media_identity("image", black, parsed=True) != S.media_identity(
        "image", _tagged_frames(0), parsed=True
    )


def test_media_identity_reads_an_image_vllm_versions_parse_apart_as_both_parses() -> None:
    # vLLM 0.34 flattens an RGB image's transparency colour, 0.32 does not: the image is
    # not its flattened twin, nor a list of its two parses (helper-80).
    pixels = np.random.default_rng(3).integers(0, 200, (4, 4, 3), dtype=np.uint8)
    pixels[0] = (0, 255, 0)
    keyed = Image.fromarray(pixels)
    keyed.info["transparency"] = (0, 255, 0)
    flat = pixels.copy()
    flat[0] = 255
    identity = S.media_identity("image", keyed, parsed=True)
    assert identity != S.media_identity("image", Image.fromarray(flat), parsed=True)
    assert identity != S.media_identity(
        "image", [Image.fromarray(flat), Image.fromarray(pixels)], parsed=True
    )
    assert identity == S.media_identity("image", keyed.copy(), parsed=True)


def test_videos_of_frames_sharing_an_image_id_are_drawn() -> None:
    # So a check that reads frames by their ID (vllm-omni's helper does) can be caught.
    def shares_an_id(pair: tuple[Any, Any]) -> bool:
        if not all(isinstance(video, list) and isinstance(video[0], Image.Image) for video in pair):
            return False
        ids = {frame.getexif().get(0x800D) for video in pair for frame in video}
        pixels = [np.stack([np.asarray(frame) for frame in video]) for video in pair]
        return len(ids) == 1 and None not in ids and not np.array_equal(*pixels)

    find(st.tuples(S.videos(), S.videos()), shares_an_id, settings=settings(max_examples=2000, database=None))


@pytest.mark.parametrize("modality", S.MODALITIES)
@FEW
@given(data=st.data())
def test_media_identity_agrees_with_the_content_hash(modality: str, data: st.DataObject) -> None:
    from omni_requests.testing import _copy_media

    hasher = MediaHasher("m")
    a = data.draw(S.media_items(modality, embeddings=True), label="a")
    b = data.draw(S.media_items(modality, embeddings=True), label="b")
    assert S.media_identity(modality, a) == S.media_identity(modality, _copy_media(a))
    same_identity = S.media_identity(modality, a) == S.media_identity(modality, b)
    assert same_identity == (hasher.key(modality, a) == hasher.key(modality, b))
