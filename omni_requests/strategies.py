"""Hypothesis strategies for media, prompt records, templates with copies, and replica layouts.

Importing this module needs Hypothesis (``pip install hypothesis``); the rest of
omni-requests never imports it. Images need Pillow and tensors need torch; only the
strategies that make them import them.

Media is kept tiny (a few pixels, frames or samples), so a failing test shrinks to an
example you can read: a 1x1 black RGB image, a 0-d array, a one-sample waveform.

Every strategy checks its arguments when it is created and raises Hypothesis'
``InvalidArgument`` naming the argument:

>>> images(min_side=4, max_side=2)
Traceback (most recent call last):
...
hypothesis.errors.InvalidArgument: images(): max_side=2 must be >= min_side=4

``st.from_type`` resolves the prompt records and :class:`~omni_requests.MediaHasher` to
these strategies: Hypothesis registers them at its import, through the ``hypothesis``
entry-point group, from the small ``omni_requests._hypothesis_hook`` (not from this
module, which imports Hypothesis and so cannot be loaded while Hypothesis is).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import pickle
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

import attrs
import numpy as np
from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.extra import numpy as hnp

from ._exif import EXIF_IMAGE_ID
from ._hashing import ALGORITHMS, MediaHasher, _exif_image_id, image_parses
from ._media import IMAGE_MODES as _MODES
from ._media import PALETTE_MODES, MediaKind, is_pil_image, media_kind, tensor_bytes
from ._records import EmbedsPrompt, EncoderDecoderPrompt, Prompt, SinglePrompt, TextPrompt, TokensPrompt

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "ARRAY_DTYPES",
    "HASH_ALGORITHMS",
    "IMAGE_MODES",
    "MODALITIES",
    "PROMPT_KINDS",
    "TENSOR_DTYPES",
    "ReplicaLayout",
    "TemplateCopies",
    "arrays",
    "audios",
    "embeds_prompts",
    "hashers",
    "images",
    "media_identity",
    "media_items",
    "multi_modal_data",
    "prompts",
    "replica_layouts",
    "templates_with_copies",
    "tensors",
    "text_prompts",
    "tokens_prompts",
    "videos",
]

_T = TypeVar("_T")

IMAGE_MODES: Final = _MODES
"""Every Pillow mode :func:`images` can make; the first ones are what examples shrink to."""

ARRAY_DTYPES: Final = (
    "uint8",
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    ">i4",
    ">f8",
)
"""The numpy dtypes :func:`arrays` draws from by default (big-endian ones included:
the key hashes ``dtype.str``, so byte order is part of an array's identity)."""

TENSOR_DTYPES: Final = (
    "float32",
    "bfloat16",
    "float16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
)
"""The torch dtypes :func:`tensors` draws from by default."""

MODALITIES: Final = ("image", "video", "audio")
HASH_ALGORITHMS: Final = ALGORITHMS
PROMPT_KINDS: Final = ("text", "tokens", "embeds", "encoder_decoder")

_SAMPLE_RATES: Final = (16000, 8000, 22050, 44100, 48000)


# -- shared leaf strategies ----------------------------------------------------------
# Building a strategy costs far more than drawing from it (Hypothesis validates it on
# first use), so the ones made inside draws are cached by their arguments.


@functools.lru_cache(maxsize=1024)
def _exact_bytes(size: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=size, max_size=size)


@functools.lru_cache(maxsize=4096)
def _array_values(
    dtype: np.dtype[Any], shape: tuple[int, ...], elements: st.SearchStrategy[Any] | None = None
) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    return hnp.arrays(dtype, shape, elements=elements)


_LAYOUTS: Final = st.sampled_from(("C", "F", "strided", "reversed", "swapped"))
_TENSOR_LAYOUTS: Final = st.sampled_from(("C", "transposed", "strided"))
_EXIF_FORMS: Final = st.sampled_from((None, "uuid", "str"))
_PALETTE_MODES: Final = st.sampled_from(PALETTE_MODES)
_UINT128: Final = st.integers(0, 2**128 - 1)
_SAMPLES: Final = st.floats(-1.0, 1.0, width=32)


# -- argument checks ----------------------------------------------------------------


def _fail(where: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {message}")


def _check_int(where: str, name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"{name}={value!r} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise _fail(where, f"{name}={value!r} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise _fail(where, f"{name}={value!r} must be <= {maximum}")
    return value


def _check_range(where: str, low_name: str, low: int, high_name: str, high: int) -> None:
    if high < low:
        raise _fail(where, f"{high_name}={high!r} must be >= {low_name}={low!r}")


def _check_bool(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, f"{name}={value!r} must be a bool, got {type(value).__name__}")
    return value


def _check_optional_bool(where: str, name: str, value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _fail(where, f"{name}={value!r} must be True, False or None, got {type(value).__name__}")
    return value


def _check_choices(
    where: str, name: str, value: Iterable[_T] | None, allowed: Sequence[_T], default: Sequence[_T]
) -> tuple[_T, ...]:
    if value is None:
        return tuple(default)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail(where, f"{name}={value!r} must be a list of values, not {type(value).__name__}")
    chosen = tuple(value)
    if not chosen:
        raise _fail(where, f"{name} must not be empty")
    for item in chosen:
        if item not in allowed:
            raise _fail(where, f"{name} contains {item!r}; choose from {', '.join(map(repr, allowed))}")
    return tuple(dict.fromkeys(chosen))


def _check_strategy(where: str, name: str, value: object) -> None:
    if value is not None and not isinstance(value, st.SearchStrategy):
        raise _fail(where, f"{name}={value!r} must be a Hypothesis strategy, got {type(value).__name__}")


def _require(module: str, where: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(
            f"{where} needs {module}, which is not installed; pip install 'omni-requests[{extra}]'",
            name=module,
        )


def _torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _pil_available() -> bool:
    return importlib.util.find_spec("PIL") is not None


# -- images ---------------------------------------------------------------------------


def images(
    *,
    modes: Iterable[str] | None = None,
    min_side: int = 1,
    max_side: int = 16,
    palettes: bool = True,
    exif_image_ids: bool = True,
) -> st.SearchStrategy[Image.Image]:
    """PIL images in every mode of :data:`IMAGE_MODES` (or ``modes``), sides in [min_side, max_side].

    ``palettes``: "P" and "PA" images get a drawn palette (RGB or RGBA, 1 to 16 entries),
    which is part of the key. ``exif_image_ids``: some images carry an EXIF ``ImageID``
    (tag 0x800D); vLLM keys such an image by that UUID alone, ignoring its pixels.
    Some carry the tag as a string, which vLLM ignores. Pixels are drawn as raw bytes,
    so "F" and "I" images hold any value, NaN included.
    """
    where = "images()"
    _require("PIL", where, "images")
    chosen = _check_choices(where, "modes", modes, IMAGE_MODES, IMAGE_MODES)
    _check_int(where, "min_side", min_side, minimum=1)
    _check_int(where, "max_side", max_side, minimum=1)
    _check_range(where, "min_side", min_side, "max_side", max_side)
    _check_bool(where, "palettes", palettes)
    _check_bool(where, "exif_image_ids", exif_image_ids)
    return _images(chosen, min_side, max_side, palettes, exif_image_ids)


@functools.lru_cache(maxsize=256)
def _images(
    modes: tuple[str, ...], min_side: int, max_side: int, palettes: bool, exif: bool
) -> st.SearchStrategy[Image.Image]:
    return _draw_images(st.sampled_from(modes), st.integers(min_side, max_side), palettes, exif)


@st.composite
def _draw_images(
    draw: st.DrawFn,
    modes: st.SearchStrategy[str],
    sides: st.SearchStrategy[int],
    palettes: bool,
    exif: bool,
) -> Image.Image:
    from PIL import Image

    mode = draw(modes)
    image = Image.new(mode, (draw(sides), draw(sides)))
    image.frombytes(draw(_exact_bytes(len(image.tobytes()))))
    if palettes and mode in ("P", "PA"):
        rawmode = draw(_PALETTE_MODES)
        entries = draw(st.integers(1, 16))
        image.putpalette(draw(_exact_bytes(len(rawmode) * entries)), rawmode)
    if exif:
        tag = draw(_EXIF_FORMS)
        if tag is not None:
            image_id = uuid.UUID(int=draw(_UINT128))
            image.getexif()[EXIF_IMAGE_ID] = image_id if tag == "uuid" else str(image_id)
    return image


# -- arrays and tensors -------------------------------------------------------------


def _numpy_dtypes(where: str, dtypes: Iterable[object] | None) -> tuple[np.dtype[Any], ...]:
    if dtypes is None:
        return tuple(np.dtype(d) for d in ARRAY_DTYPES)
    if isinstance(dtypes, (str, bytes)) or not isinstance(dtypes, Iterable):
        raise _fail(where, f"dtypes={dtypes!r} must be a list of dtypes, not {type(dtypes).__name__}")
    chosen = []
    for dtype in dtypes:
        try:
            resolved = np.dtype(dtype)  # type: ignore[call-overload]
        except TypeError:
            raise _fail(where, f"dtypes contains {dtype!r}, which is not a numpy dtype") from None
        if resolved.kind not in "biufc":
            raise _fail(where, f"dtypes contains {dtype!r}; media arrays must be bool or numeric")
        chosen.append(resolved)
    if not chosen:
        raise _fail(where, "dtypes must not be empty")
    return tuple(chosen)


def arrays(
    *,
    dtypes: Iterable[object] | None = None,
    max_dims: int = 4,
    max_side: int = 6,
    non_contiguous: bool = True,
    min_dims: int = 0,
    min_side: int = 1,
) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    """Numpy arrays of the dtypes in :data:`ARRAY_DTYPES` (or ``dtypes``), 0-d included.

    With ``non_contiguous`` the same values come in several memory layouts: C order,
    Fortran order, every other row of a bigger array, a reversed view, and axes swapped
    back from a contiguous copy. vLLM hashes an array's C-order bytes, so layout must
    never change a key. Floats include NaN, infinities and -0.0.
    """
    where = "arrays()"
    chosen = _numpy_dtypes(where, dtypes)
    _check_bool(where, "non_contiguous", non_contiguous)
    shapes = _shapes(where, min_dims, max_dims, min_side, max_side)
    return _arrays(st.sampled_from(chosen), shapes, non_contiguous)


def _shapes(
    where: str, min_dims: int, max_dims: int, min_side: int, max_side: int
) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes, after checking the bounds the caller gave."""
    _check_int(where, "min_dims", min_dims, minimum=0, maximum=32)
    _check_int(where, "max_dims", max_dims, minimum=0, maximum=32)
    _check_range(where, "min_dims", min_dims, "max_dims", max_dims)
    _check_int(where, "min_side", min_side, minimum=0)
    _check_int(where, "max_side", max_side, minimum=0)
    _check_range(where, "min_side", min_side, "max_side", max_side)
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


@st.composite
def _arrays(
    draw: st.DrawFn,
    dtypes: st.SearchStrategy[np.dtype[Any]],
    shapes: st.SearchStrategy[tuple[int, ...]],
    non_contiguous: bool,
) -> np.ndarray[Any, Any]:
    dtype = draw(dtypes)
    array: np.ndarray[Any, Any] = draw(_array_values(dtype, draw(shapes)))
    return _relayout(draw, array) if non_contiguous else array


def _relayout(draw: st.DrawFn, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The same values in a drawn memory layout."""
    if array.ndim == 0:
        return array
    layout = draw(_LAYOUTS)
    if layout == "F":
        return np.asfortranarray(array)
    if layout == "strided":
        base = np.zeros((2 * array.shape[0], *array.shape[1:]), dtype=array.dtype)
        base[::2] = array
        return base[::2]
    if layout == "reversed":
        return np.ascontiguousarray(array[::-1])[::-1]
    if layout == "swapped" and array.ndim >= 2:
        return np.ascontiguousarray(np.swapaxes(array, 0, -1)).swapaxes(0, -1)
    return array


def tensors(
    *,
    dtypes: Iterable[object] | None = None,
    max_dims: int = 3,
    max_side: int = 6,
    non_contiguous: bool = True,
    min_dims: int = 0,
    min_side: int = 1,
) -> st.SearchStrategy[Any]:
    """Torch tensors of the dtypes in :data:`TENSOR_DTYPES` (or ``dtypes``: names or torch dtypes).

    bfloat16 is included (vLLM hashes it specially). With ``non_contiguous`` the same
    values also come transposed back from a contiguous copy, or as every other row of a
    bigger tensor. Needs torch, imported here and not before.
    """
    where = "tensors()"
    _require("torch", where, "torch")
    import torch

    names = _check_tensor_dtypes(where, dtypes)
    _check_bool(where, "non_contiguous", non_contiguous)
    shapes = _shapes(where, min_dims, max_dims, min_side, max_side)
    return _tensors(torch, st.sampled_from(names), shapes, non_contiguous)


def _check_tensor_dtypes(where: str, dtypes: Iterable[object] | None) -> tuple[str, ...]:
    import torch

    if dtypes is None:
        return TENSOR_DTYPES
    if isinstance(dtypes, (str, bytes)) or not isinstance(dtypes, Iterable):
        raise _fail(where, f"dtypes={dtypes!r} must be a list of dtypes, not {type(dtypes).__name__}")
    names = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
        if name not in TENSOR_DTYPES:
            raise _fail(where, f"dtypes contains {dtype!r}; choose from {', '.join(TENSOR_DTYPES)}")
        names.append(name)
    if not names:
        raise _fail(where, "dtypes must not be empty")
    return tuple(names)


@st.composite
def _tensors(
    draw: st.DrawFn,
    torch: Any,
    names: st.SearchStrategy[str],
    shapes: st.SearchStrategy[tuple[int, ...]],
    non_contiguous: bool,
) -> Any:
    name = draw(names)
    values = draw(_array_values(np.dtype("float32" if name == "bfloat16" else name), draw(shapes)))
    tensor = torch.from_numpy(values.copy()).to(getattr(torch, name))
    if not non_contiguous or tensor.ndim == 0:
        return tensor
    layout = draw(_TENSOR_LAYOUTS)
    if layout == "transposed" and tensor.ndim >= 2:
        return tensor.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "strided" and not (tensor.numel() == 1 and name == "bfloat16"):
        # (Records refuse a strided one-element bfloat16 tensor: vLLM has no key for it.)
        # On the CPU, as the rest: a test may run under torch.set_default_device(...).
        base = torch.zeros((2 * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device="cpu")
        base[::2] = tensor
        return base[::2]
    return tensor


# -- videos and audio -----------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _pixels(shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    """uint8 arrays drawn as raw bytes: one draw per array, shrinking to black."""
    return _pixels_from_bytes(shape, _exact_bytes(int(np.prod(shape))))


@st.composite
def _pixels_from_bytes(
    draw: st.DrawFn, shape: tuple[int, ...], raw: st.SearchStrategy[bytes]
) -> np.ndarray[Any, Any]:
    return np.frombuffer(draw(raw), np.uint8).reshape(shape).copy()


def videos(
    *, max_frames: int = 3, max_side: int = 4, frame_images: bool = True, metadata: bool = True
) -> st.SearchStrategy[Any]:
    """One video, in each form vLLM accepts.

    A 4-D uint8 array (frames, height, width, channels); a list of 3-D frames; a list of
    PIL images (``frame_images``, needs Pillow; in some videos every frame carries one EXIF
    ``ImageID``, which vLLM's hasher keys a bare image by but its parser drops when it
    stacks the frames); or a ``(frames, metadata)`` tuple
    (``metadata``) with a dict like the one vLLM's video loader returns, whose keys and
    their order are part of the key.
    """
    where = "videos()"
    _check_int(where, "max_frames", max_frames, minimum=1)
    _check_int(where, "max_side", max_side, minimum=1)
    _check_bool(where, "frame_images", frame_images)
    _check_bool(where, "metadata", metadata)
    if frame_images:
        _require("PIL", where, "images")
    return _videos(max_frames, max_side, frame_images, metadata)


@st.composite
def _videos(draw: st.DrawFn, max_frames: int, max_side: int, frame_images: bool, metadata: bool) -> Any:
    forms = (
        ["array", "frames"] + (["images"] if frame_images else []) + (["with_metadata"] if metadata else [])
    )
    form = draw(st.sampled_from(forms))
    count = draw(st.integers(1, max_frames))
    height, width = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    channels = draw(st.sampled_from((3, 1)))
    if form == "frames":
        frame = (height, width, channels)
        return [_relayout(draw, draw(_pixels(frame))) for _ in range(count)]
    if form == "images":
        from PIL import Image

        images = [Image.fromarray(draw(_pixels((height, width, 3)))) for _ in range(count)]
        if draw(st.booleans()):
            image_id = uuid.UUID(int=draw(_UINT128))
            for image in images:
                image.getexif()[EXIF_IMAGE_ID] = image_id
        return images
    frames = _relayout(draw, draw(_pixels((count, height, width, channels))))
    if form == "array":
        return frames
    fps = float(draw(st.integers(1, 30)))
    info: dict[str, Any] = {"total_num_frames": count, "fps": fps, "duration": count / fps}
    if draw(st.booleans()):
        info["frames_indices"] = list(range(count))
    if draw(st.booleans()):
        info["video_backend"] = "opencv"
    return (frames, info)


def audios(*, max_samples: int = 8, sample_rates: Iterable[int] | None = None) -> st.SearchStrategy[Any]:
    """One audio clip: ``(waveform, sample_rate)``, a bare 1-D float array, or a list of floats.

    Samples lie in [-1, 1] (with -0.0). The engine resamples ``(waveform, rate)`` before
    hashing; these keys are the ones a prompt gets before that step.
    """
    where = "audios()"
    _check_int(where, "max_samples", max_samples, minimum=1)
    rates: tuple[int, ...] = _SAMPLE_RATES
    if sample_rates is not None:
        rates = tuple(sample_rates)
        if not rates:
            raise _fail(where, "sample_rates must not be empty")
        for rate in rates:
            _check_int(where, "sample_rates[...]", rate, minimum=1)
    return _audios(max_samples, rates)


@st.composite
def _audios(draw: st.DrawFn, max_samples: int, rates: tuple[int, ...]) -> Any:
    form = draw(st.sampled_from(("tuple", "array", "list")))
    count = draw(st.integers(1, max_samples))
    if form == "list":
        return draw(st.lists(st.floats(-1.0, 1.0), min_size=count, max_size=count))
    dtype = draw(st.sampled_from((np.float32, np.float64)))
    waveform = _relayout(draw, draw(_array_values(np.dtype(dtype), (count,), _SAMPLES)))
    return (waveform, draw(st.sampled_from(rates))) if form == "tuple" else waveform


# -- media items and multi_modal_data -------------------------------------------------


def media_items(modality: str, *, embeddings: bool = False) -> st.SearchStrategy[Any]:
    """One media item for ``modality`` ("image", "video" or "audio"), as vLLM accepts it.

    Images are PIL images (when Pillow is installed; any mode but "La", which vLLM's parser
    cannot turn into RGB), (height, width, channels) uint8 arrays, or 3-D arrays of any
    dtype and layout from :func:`arrays` (the model's processor takes no image of fewer
    dimensions). With ``embeddings`` an item may also be a 2-D float tensor of precomputed
    embeddings (needs torch); the prompt strategies make a modality whose first item is
    one hold only such tensors, as vLLM's parser reads the list.
    """
    where = "media_items()"
    if modality not in MODALITIES:
        raise _fail(where, f"modality={modality!r}; choose from {', '.join(MODALITIES)}")
    _check_bool(where, "embeddings", embeddings)
    return _media_items(modality, embeddings)


@st.composite
def _pixel_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    """An (height, width, 3) uint8 image array, in a drawn layout."""
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 4)), 3)
    return _relayout(draw, draw(_pixels(shape)))


@functools.lru_cache(maxsize=16)
def _media_items(modality: str, embeddings: bool) -> st.SearchStrategy[Any]:
    options: list[st.SearchStrategy[Any]] = []
    if modality == "image":
        if _pil_available():  # not "La": vLLM's parser cannot turn it into RGB
            options.append(images(modes=[m for m in IMAGE_MODES if m != "La"], max_side=4))
        options.append(_pixel_arrays())
        options.append(arrays(min_dims=3, max_dims=3, max_side=3))
    elif modality == "video":
        options.append(videos(frame_images=_pil_available()))
    else:
        options.append(audios())
    if embeddings:
        options.append(_embedding_tensors())
    return st.one_of(options)


def _embedding_tensors() -> st.SearchStrategy[Any]:
    return tensors(dtypes=("float32", "float16", "bfloat16"), min_dims=2, max_dims=2, max_side=4)


def _is_embedding(item: object) -> bool:
    """A 2-D tensor: as a modality's first item, vLLM's parser reads the list as embeddings
    and refuses any other item in it."""
    return media_kind(item) is MediaKind.TENSOR and item.ndim == 2  # type: ignore[attr-defined]


def multi_modal_data(
    *,
    modalities: Iterable[str] | None = None,
    min_modalities: int = 1,
    max_items: int = 2,
    embeddings: bool = False,
) -> st.SearchStrategy[dict[str, list[Any]]]:
    """A ``multi_modal_data`` dict: each drawn modality maps to a list of 1 to max_items items."""
    where = "multi_modal_data()"
    chosen = _check_choices(where, "modalities", modalities, MODALITIES, MODALITIES)
    _check_int(where, "min_modalities", min_modalities, minimum=0, maximum=len(chosen))
    _check_int(where, "max_items", max_items, minimum=1)
    _check_bool(where, "embeddings", embeddings)
    return _multi_modal_data(chosen, min_modalities, max_items, embeddings)


@st.composite
def _multi_modal_data(
    draw: st.DrawFn, modalities: tuple[str, ...], min_modalities: int, max_items: int, embeddings: bool
) -> dict[str, list[Any]]:
    drawn = draw(st.lists(st.sampled_from(modalities), min_size=min_modalities, unique=True))
    data = {}
    for modality in drawn:
        items = draw(st.lists(_media_items(modality, embeddings), min_size=1, max_size=max_items))
        if _is_embedding(items[0]):  # then every item is one
            items[1:] = [draw(_embedding_tensors()) for _ in items[1:]]
        data[modality] = items
    return data


# -- prompt records -------------------------------------------------------------------

_user_uuids = st.uuids().map(str)


@attrs.frozen
class _MediaOptions:
    modalities: tuple[str, ...]
    max_items: int
    media: bool | None
    user_uuids: bool
    none_items: bool
    embeddings: bool


def _media_options(
    where: str,
    modalities: Iterable[str] | None,
    max_items: int,
    media: bool | None,
    user_uuids: bool,
    none_items: bool,
    embeddings: bool,
) -> _MediaOptions:
    chosen = _check_choices(where, "modalities", modalities, MODALITIES, MODALITIES)
    _check_int(where, "max_items", max_items, minimum=1)
    _check_optional_bool(where, "media", media)
    _check_bool(where, "user_uuids", user_uuids)
    _check_bool(where, "none_items", none_items)
    _check_bool(where, "embeddings", embeddings)
    if none_items and not user_uuids:
        raise _fail(where, "none_items=True needs user_uuids=True: a None item is known only by its UUID")
    return _MediaOptions(chosen, max_items, media, user_uuids, none_items, embeddings)


@functools.lru_cache(maxsize=256)
@st.composite
def _media_fields(draw: st.DrawFn, options: _MediaOptions) -> dict[str, Any]:
    """``multi_modal_data`` and ``multi_modal_uuids`` keyword arguments, consistent with each other."""
    if options.media is False:
        return {}
    minimum = 1 if options.media else 0
    drawn = draw(st.lists(st.sampled_from(options.modalities), min_size=minimum, unique=True))
    data: dict[str, list[Any]] = {}
    uuids: dict[str, list[str | None]] = {}
    used: set[str] = set()  # one UUID names one item (records refuse one over two)
    new_uuids = _user_uuids.filter(lambda uuid_: uuid_ not in used)
    for modality in drawn:
        count = draw(st.integers(1, options.max_items))
        items: list[Any] = []
        keys: list[str | None] = []
        for _ in range(count):
            uuid_ = draw(new_uuids) if options.user_uuids and draw(st.booleans()) else None
            if uuid_ is not None:
                used.add(uuid_)
            embedded = bool(items) and _is_embedding(items[0])  # then every item is one
            cached_only = uuid_ is not None and options.none_items and not embedded and draw(st.booleans())
            if cached_only:
                items.append(None)
            else:
                items.append(
                    draw(_embedding_tensors() if embedded else _media_items(modality, options.embeddings))
                )
            keys.append(uuid_)
        data[modality] = items
        if any(k is not None for k in keys):
            uuids[modality] = keys
    if options.none_items:
        # A modality named only in the UUIDs: items the engine is told to take from its cache.
        unused = [m for m in options.modalities if m not in data]
        wanted = draw(st.booleans())
        if unused and wanted:
            cached: list[str | None] = list(
                draw(st.lists(new_uuids, min_size=1, max_size=options.max_items, unique=True))
            )
            uuids[draw(st.sampled_from(unused))] = cached
    fields: dict[str, Any] = {}
    if data:
        fields["multi_modal_data"] = data
    if uuids:
        fields["multi_modal_uuids"] = uuids
    return fields


_words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz <>", max_size=16)
_json_scalars = st.none() | st.booleans() | st.integers(-100, 100) | st.text(max_size=8)
_stage_payloads = st.dictionaries(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8),
    _json_scalars | st.lists(_json_scalars, max_size=3),
    max_size=3,
)


@functools.lru_cache(maxsize=256)
@st.composite
def _common_fields(draw: st.DrawFn, options: _MediaOptions, omni_fields: bool) -> dict[str, Any]:
    fields = draw(_media_fields(options))
    if draw(st.booleans()):
        fields["cache_salt"] = draw(st.text(min_size=1, max_size=8))
    if omni_fields:
        if draw(st.booleans()):
            fields["negative_prompt"] = draw(_words)
        if draw(st.booleans()):
            fields["additional_information"] = draw(_stage_payloads)
    return fields


def _prompt_arguments(where: str, text: object, omni_fields: object) -> None:
    _check_strategy(where, "text", text)
    _check_bool(where, "omni_fields", omni_fields)


def text_prompts(
    *,
    modalities: Iterable[str] | None = None,
    max_items: int = 2,
    media: bool | None = None,
    user_uuids: bool = True,
    none_items: bool = True,
    omni_fields: bool = True,
    embeddings: bool = False,
    text: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[TextPrompt]:
    """:class:`~omni_requests.TextPrompt` records.

    ``media``: True always gives media, False never, None (default) either. With
    ``user_uuids`` some items carry a UUID, each its own within the prompt (records
    refuse one UUID over two items of other media); with ``none_items`` some of those are ``None``
    (cached only) and a modality may be named in the UUIDs alone. ``omni_fields`` adds
    vllm-omni's ``negative_prompt`` and ``additional_information`` now and then.
    ``text`` replaces the strategy for the prompt text (to place an ``<image>`` token, say).
    """
    where = "text_prompts()"
    options = _media_options(where, modalities, max_items, media, user_uuids, none_items, embeddings)
    _prompt_arguments(where, text, omni_fields)
    return _text_prompts(options, omni_fields, _words if text is None else text)


@st.composite
def _text_prompts(
    draw: st.DrawFn, options: _MediaOptions, omni_fields: bool, text: st.SearchStrategy[str]
) -> TextPrompt:
    return TextPrompt(prompt=draw(text), **draw(_common_fields(options, omni_fields)))


def tokens_prompts(
    *,
    modalities: Iterable[str] | None = None,
    max_items: int = 2,
    media: bool | None = None,
    user_uuids: bool = True,
    none_items: bool = True,
    omni_fields: bool = True,
    embeddings: bool = False,
    max_tokens: int = 8,
) -> st.SearchStrategy[TokensPrompt]:
    """:class:`~omni_requests.TokensPrompt` records; arguments as for :func:`text_prompts`."""
    where = "tokens_prompts()"
    options = _media_options(where, modalities, max_items, media, user_uuids, none_items, embeddings)
    _prompt_arguments(where, None, omni_fields)
    _check_int(where, "max_tokens", max_tokens, minimum=1)
    return _tokens_prompts(options, omni_fields, max_tokens)


@st.composite
def _tokens_prompts(
    draw: st.DrawFn, options: _MediaOptions, omni_fields: bool, max_tokens: int
) -> TokensPrompt:
    ids = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=max_tokens))
    fields = draw(_common_fields(options, omni_fields))
    if draw(st.booleans()):
        fields["token_type_ids"] = [0] * len(ids)
    return TokensPrompt(prompt_token_ids=ids, **fields)


def embeds_prompts(
    *,
    modalities: Iterable[str] | None = None,
    max_items: int = 2,
    media: bool | None = None,
    user_uuids: bool = True,
    none_items: bool = True,
    omni_fields: bool = True,
    embeddings: bool = False,
) -> st.SearchStrategy[EmbedsPrompt]:
    """:class:`~omni_requests.EmbedsPrompt` records (needs torch); arguments as for :func:`text_prompts`."""
    where = "embeds_prompts()"
    _require("torch", where, "torch")
    options = _media_options(where, modalities, max_items, media, user_uuids, none_items, embeddings)
    _prompt_arguments(where, None, omni_fields)
    embeds = tensors(dtypes=("float32", "float16", "bfloat16"), min_dims=2, max_dims=2, max_side=4)
    return _embeds_prompts(options, omni_fields, embeds)


@st.composite
def _embeds_prompts(
    draw: st.DrawFn, options: _MediaOptions, omni_fields: bool, embeds: st.SearchStrategy[Any]
) -> EmbedsPrompt:
    fields = draw(_common_fields(options, omni_fields))
    fields.pop("negative_prompt", None)  # an EmbedsPrompt has no negative_prompt field
    return EmbedsPrompt(prompt_embeds=draw(embeds), **fields)


def prompts(
    *,
    kinds: Iterable[str] | None = None,
    modalities: Iterable[str] | None = None,
    max_items: int = 2,
    media: bool | None = None,
    user_uuids: bool = True,
    none_items: bool = True,
    omni_fields: bool = True,
    embeddings: bool = False,
) -> st.SearchStrategy[Prompt]:
    """Prompt records of the ``kinds`` in :data:`PROMPT_KINDS`.

    The default is every single-prompt kind: "text", "tokens", and "embeds" where torch
    is installed. "encoder_decoder" gives an :class:`~omni_requests.EncoderDecoderPrompt`
    whose encoder prompt holds the media. Other arguments as for :func:`text_prompts`.
    """
    where = "prompts()"
    default = ("text", "tokens", "embeds") if _torch_available() else ("text", "tokens")
    chosen = _check_choices(where, "kinds", kinds, PROMPT_KINDS, default)
    if "embeds" in chosen:
        _require("torch", where + " with kind 'embeds'", "torch")
    args: dict[str, Any] = {
        "modalities": modalities,
        "max_items": max_items,
        "media": media,
        "user_uuids": user_uuids,
        "none_items": none_items,
        "omni_fields": omni_fields,
        "embeddings": embeddings,
    }
    makers: dict[str, Callable[..., st.SearchStrategy[Any]]] = {
        "text": text_prompts,
        "tokens": tokens_prompts,
        "embeds": embeds_prompts,
    }
    options: list[st.SearchStrategy[Any]] = [makers[k](**args) for k in chosen if k in makers]
    if "encoder_decoder" in chosen:
        decoders = st.none() | text_prompts(media=False, omni_fields=False)
        encoders = st.one_of([makers[k](**args) for k in ("text", "tokens")])
        options.append(st.builds(EncoderDecoderPrompt, encoder_prompt=encoders, decoder_prompt=decoders))
    return st.one_of(options)


_all_prompts = prompts


# -- templates with copies ------------------------------------------------------------


class TemplateCopies(NamedTuple):
    """A template record and copies of it made with ``attrs.evolve``, each with new media."""

    template: SinglePrompt
    copies: tuple[SinglePrompt, ...]


def media_identity(
    modality: str, item: object, uuid: str | None = None, *, parsed: bool = False
) -> tuple[str, ...]:
    """What an item's key is a function of: its user UUID, else its modality and content.

    Two items with equal identities must get equal keys on one replica, and items with
    different identities different keys. Content is read the way vLLM's hasher reads
    it (an array's dtype, shape and C-order bytes; an image's mode, pixels and palette,
    or its EXIF ``ImageID`` alone; a dict's keys in order; lists and tuples alike), but
    without :class:`~omni_requests.MediaHasher`, so a hasher that mixes up media cannot
    hide it from checks built on this.

    >>> import numpy as np
    >>> a = np.arange(6, dtype=np.uint8).reshape(2, 3)
    >>> media_identity("image", a) == media_identity("image", np.asfortranarray(a))
    True
    >>> media_identity("image", a, "cat-1")
    ('user', 'cat-1')

    With ``parsed=True`` an item is read as vLLM's parser hands it to the model: a PIL
    image under ``image`` turned upright by its EXIF orientation and flattened to RGB (in
    both of vLLM's readings of an RGB image's transparency colour where they differ), and
    every PIL image by its pixels, never its ``ImageID`` (a video's frames are stacked
    into one array; a list of images as one item is the model's to read). Items equal
    in that view are the same input to the model, so they may share a key.
    """
    if uuid is not None:
        return ("user", uuid)
    content: object
    # No parse for modes vLLM cannot parse (kept as given); two where vLLM versions parse
    # the image apart: what each gives the model, marked as no item's content can be.
    if parsed and modality == "image" and is_pil_image(item) and (parses := image_parses(item)):
        seen = [_content(parse, by_id=False) for parse in parses]
        content = seen[0] if len(seen) == 1 else ("two parses", *seen)
    else:
        content = _content(item, by_id=not parsed)
    digest = hashlib.sha256(repr(content).encode()).hexdigest()
    return ("content", modality, digest)


def _content(value: object, by_id: bool = True) -> object:
    """A plain, comparable picture of what vLLM's hasher reads from ``value`` (an image by
    its EXIF ``ImageID`` where it has one, unless not ``by_id``)."""
    if value is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, (int, float)):  # vLLM hashes np.array(value).tobytes(), untagged
        # Read as the model gets it, 1 and 5e-324 (the same bytes) are other numbers.
        typed = () if by_id else (type(value).__name__,)
        return ("number", *typed, np.array(value).tobytes())
    media: Any = value
    kind = media_kind(value)
    if kind is MediaKind.ARRAY:
        data = _content(media.item(), by_id) if media.ndim == 0 else media.tobytes()
        return ("ndarray", media.dtype.str, media.shape, data)
    if kind is MediaKind.IMAGE:
        image_id = _exif_image_id(media) if by_id else None
        if image_id is not None:
            return image_id
        pixels = np.asarray(media)
        palette = media.palette
        colors: tuple[object, ...] | None = None
        if palette is not None:
            colors = (_content(palette.palette, by_id), palette.rawmode)
            if not by_id:  # one palette's bytes as RGB or RGBA: other colours
                colors = (*colors, palette.mode)
        # Read as the model sees it, a transparency entry is content (a processor given
        # the image as it is composites it onto white).
        seen: tuple[object, ...] = ()
        if not by_id and "transparency" in media.info:
            seen = ("transparency", _content(media.info["transparency"]))
        return ("image", media.mode, pixels.dtype.str, pixels.shape, pixels.tobytes(), colors, *seen)
    if kind is MediaKind.TENSOR:
        return ("tensor", str(media.dtype), tuple(media.shape), tensor_bytes(media).tobytes())
    if kind is MediaKind.SEQUENCE:
        return ("sequence", tuple(_content(v, by_id) for v in media))
    if kind is MediaKind.MAPPING:
        return ("mapping", tuple((str(k), _content(v, by_id)) for k, v in media.items()))
    return ("pickle", pickle.dumps(value))


def templates_with_copies(
    *,
    prompts: st.SearchStrategy[SinglePrompt] | None = None,
    min_copies: int = 1,
    max_copies: int = 3,
    new_uuids: bool = False,
) -> st.SearchStrategy[TemplateCopies]:
    """A template prompt with media, and copies made from it with ``attrs.evolve``.

    Each copy replaces every item the content keys (one without a user UUID) with new
    media, different from the template's and from the other copies' (by
    :func:`media_identity`). Items with a user UUID, ``None`` ones included, stay as
    they are, so a copy changes ``multi_modal_data`` alone, like code that reuses a
    prompt dict as a template: ``{**template, "multi_modal_data": new}``. With
    ``new_uuids`` they get new media and new UUIDs too, and the copy changes
    ``multi_modal_uuids`` as well. Templates have at least one item without a UUID.
    ``prompts`` must give single prompts; the default is
    ``prompts(kinds=("text", "tokens"), media=True)``.
    """
    where = "templates_with_copies()"
    _check_strategy(where, "prompts", prompts)
    _check_int(where, "min_copies", min_copies, minimum=0)
    _check_int(where, "max_copies", max_copies, minimum=0)
    _check_range(where, "min_copies", min_copies, "max_copies", max_copies)
    _check_bool(where, "new_uuids", new_uuids)
    base: st.SearchStrategy[Any] = (
        _all_prompts(kinds=("text", "tokens"), media=True) if prompts is None else prompts
    )
    return _templates_with_copies(base.filter(_has_content_item), min_copies, max_copies, new_uuids)


def _has_content_item(prompt: object) -> bool:
    """A single prompt with an item keyed by its content (not None, no user UUID)."""
    if not isinstance(prompt, (TextPrompt, TokensPrompt, EmbedsPrompt)):
        return False
    for modality, items in prompt.multi_modal_data.items():
        given = prompt.multi_modal_uuids.get(modality)
        if any(item is not None and (given is None or given[i] is None) for i, item in enumerate(items)):
            return True
    return False


@st.composite
def _templates_with_copies(
    draw: st.DrawFn,
    templates: st.SearchStrategy[SinglePrompt],
    min_copies: int,
    max_copies: int,
    new_uuids: bool,
) -> TemplateCopies:
    template = draw(templates)
    used: set[tuple[str, ...]] = set()
    for modality, items in template.multi_modal_data.items():
        given = template.multi_modal_uuids.get(modality)
        for i, item in enumerate(items):
            used.add(media_identity(modality, item, None if given is None else given[i], parsed=True))
    for given_uuids in template.multi_modal_uuids.values():
        used.update(("user", u) for u in given_uuids if u is not None)
    copies = []
    for _ in range(draw(st.integers(min_copies, max_copies))):
        data: dict[str, list[Any]] = {}
        uuids: dict[str, Any] = dict(template.multi_modal_uuids.items())
        for modality, items in template.multi_modal_data.items():
            given = template.multi_modal_uuids.get(modality)
            row: list[Any] = []
            keys: list[str | None] = []
            for i, item in enumerate(items):
                uuid_ = None if given is None else given[i]
                if uuid_ is not None and not new_uuids:
                    row.append(item)  # a fixed asset of the template: same item, same UUID
                else:
                    row.append(
                        None if item is None else _fresh_item(draw, modality, used, _is_embedding(item))
                    )
                keys.append(None if uuid_ is None else _fresh_uuid(draw, used) if new_uuids else uuid_)
            data[modality] = row
            if given is not None:
                uuids[modality] = keys
        changes: dict[str, Any] = {"multi_modal_data": data}
        if new_uuids and template.multi_modal_uuids:
            changes["multi_modal_uuids"] = uuids
        copies.append(attrs.evolve(template, **changes))
    return TemplateCopies(template, tuple(copies))


def _fresh_uuid(draw: st.DrawFn, used: set[tuple[str, ...]]) -> str:
    """A user UUID no item seen so far has (``used`` is updated)."""
    for _ in range(8):
        value = draw(_user_uuids)
        if ("user", value) not in used:
            used.add(("user", value))
            return value
    reject()


def _fresh_item(draw: st.DrawFn, modality: str, used: set[tuple[str, ...]], embedding: bool) -> Any:
    """A media item whose identity no item seen so far has (``used`` is updated); an
    embedding tensor where it replaces one (a list of embeddings stays one)."""
    for _ in range(8):
        item = draw(_embedding_tensors() if embedding else _media_items(modality, False))
        identity = media_identity(modality, item, parsed=True)
        if identity not in used:
            used.add(identity)
            return item
    reject()


# -- replicas and hashers -------------------------------------------------------------


class ReplicaLayout(NamedTuple):
    """A stage, how many replicas it has, and the replica each successive request lands on."""

    stage_id: int
    replicas: int
    choices: tuple[int, ...]


def replica_layouts(
    *,
    min_replicas: int = 2,
    max_replicas: int = 4,
    max_stage_id: int = 2,
    min_choices: int = 1,
    max_choices: int = 8,
) -> st.SearchStrategy[ReplicaLayout]:
    """A :class:`ReplicaLayout`; choices are replica ids in ``range(replicas)``, any order."""
    where = "replica_layouts()"
    _check_int(where, "min_replicas", min_replicas, minimum=1)
    _check_int(where, "max_replicas", max_replicas, minimum=1)
    _check_range(where, "min_replicas", min_replicas, "max_replicas", max_replicas)
    _check_int(where, "max_stage_id", max_stage_id, minimum=0)
    _check_int(where, "min_choices", min_choices, minimum=0)
    _check_int(where, "max_choices", max_choices, minimum=0)
    _check_range(where, "min_choices", min_choices, "max_choices", max_choices)
    return _replica_layouts(min_replicas, max_replicas, max_stage_id, min_choices, max_choices)


@st.composite
def _replica_layouts(
    draw: st.DrawFn,
    min_replicas: int,
    max_replicas: int,
    max_stage_id: int,
    min_choices: int,
    max_choices: int,
) -> ReplicaLayout:
    stage_id = draw(st.integers(0, max_stage_id))
    replicas = draw(st.integers(min_replicas, max_replicas))
    choices = draw(st.lists(st.integers(0, replicas - 1), min_size=min_choices, max_size=max_choices))
    return ReplicaLayout(stage_id, replicas, tuple(choices))


def hashers(
    *, algorithms: Iterable[str] | None = None, model_ids: st.SearchStrategy[str] | None = None
) -> st.SearchStrategy[MediaHasher]:
    """:class:`~omni_requests.MediaHasher` over blake3, sha256 and sha512 (or ``algorithms``)."""
    where = "hashers()"
    chosen = _check_choices(where, "algorithms", algorithms, HASH_ALGORITHMS, HASH_ALGORITHMS)
    _check_strategy(where, "model_ids", model_ids)
    names = model_ids
    if names is None:
        names = st.sampled_from(("m", "org/model-7b", "/models/tiny")) | st.text(min_size=1, max_size=12)
    return st.builds(MediaHasher, names, st.sampled_from(chosen))
