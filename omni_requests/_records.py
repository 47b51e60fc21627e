"""Frozen prompt records with vLLM's (and vllm-omni's) field names.

Records take the plain values a vLLM prompt dict holds and store them frozen: maps and
lists become pyrsistent ``PMap``/``PVector``, arrays read-only views, options an
insertion-ordered :class:`FrozenDict`. Every check runs in ``__init__``, so a bad value
raises before a record exists, and ``attrs.evolve`` runs the same checks.
"""

from __future__ import annotations

import array
import math
import operator
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Self, TypeAlias, TypeGuard

import attrs
import numpy as np
from pyrsistent import PMap, PVector, pvector

from ._embedding_fields import EmbeddingFields, check_embedding_items
from ._errors import InvalidPromptError, OmniRequestsError, PromptTypeError, type_name
from ._exif import pickled_tags, restore_parser_tags, same_value
from ._frozen import refuse_second_init
from ._hashing import MediaHasher, _exif_image_id, _parsed_as, rgb_conversion_error
from ._identity import IdentityMap
from ._keys import Scope, looks_scoped, reserved_prefix
from ._media import (
    MAX_DEPTH,
    FrozenDict,
    MediaKind,
    apply_palette_state,
    as_made,
    check_code_points,
    check_image_attributes,
    check_tensor_dims,
    check_text,
    check_values_held,
    freeze_media,
    freeze_option,
    frozen_array,
    frozen_map,
    handout,
    is_frozen_map,
    is_own_array,
    is_pil_image,
    is_torch_tensor,
    media_kind,
    palette_state,
    plain_map,
    read_elements,
    read_entries,
    tensor_bytes,
    thaw,
)
from ._sealed import current, is_sealed_image, made_in_this_call

__all__ = [
    "EmbedsPrompt",
    "EncoderDecoderPrompt",
    "Prompt",
    "SinglePrompt",
    "TextPrompt",
    "TokensPrompt",
]

MediaData: TypeAlias = "PMap[str, PVector[Any]]"
MediaUUIDs: TypeAlias = "PMap[str, PVector[str | None]]"

# -- what constructors accept, to a type checker (the converters check it all at run time) --

if TYPE_CHECKING:
    import torch
    from numpy.typing import NDArray
    from PIL.Image import Image

MediaPart: TypeAlias = (
    "str | bytes | int | float | np.generic | NDArray[np.generic] | Image | torch.Tensor"
    " | tuple[MediaPart, ...] | Sequence[MediaPart] | Mapping[str, MediaPart] | None"
)
"""A value inside a media item: an audio's sampling rate, a video's metadata, an entry of
a dict of embeddings."""
MediaItem: TypeAlias = (
    "NDArray[np.generic] | Image | torch.Tensor | tuple[MediaPart, ...] | Mapping[str, MediaPart]"
    " | Sequence[NDArray[np.generic] | Image] | list[float]"
)
"""One item: an array, a PIL image or a tensor; ``(waveform, sampling_rate)`` or
``(frames, metadata)``; a dict of embeddings; a video as its frames; a waveform as floats.
Not a str or bytes: a path or an encoded file is no item (load it first)."""
ModalityData: TypeAlias = "MediaItem | Sequence[MediaItem | None] | PVector[object]"
"""One modality's value: an item, or a list of items (None for an item its UUID names).
A ``PVector`` is always a list of items, never split again: a record's own, or a loader's."""
MediaDataInput: TypeAlias = "Mapping[str, ModalityData]"
"""What ``multi_modal_data`` accepts: modality name to an item or a list of items."""
MediaUUIDsInput: TypeAlias = "Mapping[str, str | Sequence[str | None]]"
"""What ``multi_modal_uuids`` accepts: modality name to a UUID or a list of UUIDs or None."""
TokenIds: TypeAlias = "Sequence[int] | NDArray[np.integer[Any]]"
"""Token ids: a list (or tuple) of int, or a 1-D integer array."""
Options: TypeAlias = "Mapping[str, object]"
"""Keyword options and stage payloads: str keys, any values (frozen when stored)."""
StrList: TypeAlias = "list[str] | tuple[str, ...] | PVector[str]"
"""A list of str, never a str alone (a str is a sequence of str to a type checker)."""

_VISUAL_AUDIO: Final = frozenset({"image", "video", "audio"})

_EMPTY: Final[PMap[str, Any]] = frozen_map({}, "empty")


# -- splitting a modality's value into items, as vLLM's MultiModalDataParser does --

_NDIM: Final = np.ndarray.ndim.__get__


def _ndim(value: object) -> int | None:
    if isinstance(value, np.ndarray):
        # As numpy reads it (a subclass's ndim may lie), and a record's own array as made.
        return _NDIM(as_made(value))  # type: ignore[no-any-return]
    if media_kind(value) is MediaKind.TENSOR:
        # From its sizes as _shape reads them: a subclass's ndim may raise or lie.
        shape = _shape(value)
        return None if shape is None else len(shape)
    return None


def _split_items(where: str, modality: str, data: Any) -> list[object]:
    """The items vLLM sees in ``multi_modal_data[modality]``: a single item or a list.
    ``data``: a list or tuple as :func:`read_elements` read it (one read, checked and frozen)."""
    as_list = isinstance(data, (list, PVector))
    ndim = _ndim(data)
    if modality in _VISUAL_AUDIO and is_torch_tensor(data) and ndim == 3:
        return _unbound(where, data)  # a batch of embeddings, one item per row
    if modality == "image":
        if is_pil_image(data) or ndim == 3:
            return [data]
    elif modality == "video":
        if as_list and len(data) > 0 and (is_pil_image(data[0]) or all(_ndim(frame) == 3 for frame in data)):
            return [data]  # one video given as its frames
        if ndim == 4 or (isinstance(data, tuple) and len(data) == 2):
            return [data]  # one video, or (frames, metadata)
        if isinstance(data, tuple):
            return list(data)  # any other tuple is a tuple of videos to vLLM
    elif modality == "audio":
        if as_list and len(data) > 0 and isinstance(data[0], float):
            return [data]  # one waveform given as a list of floats
        if ndim == 1 or isinstance(data, tuple):
            return [data]
    if ndim is not None:  # an array (a plain view: see _convert_media) or a tensor
        return _unbound(where, as_made(data) if type(data) is np.ndarray else data)
    if as_list or (modality == "image" and isinstance(data, tuple)):
        return list(data)
    return [data]


def _unbound(where: str, data: Any) -> list[object]:
    """An array's or tensor's rows, as vLLM's parser splits it. A plain one's split runs no
    caller code; a tensor subclass's (``torch.masked.MaskedTensor``) may raise: by name."""
    torch = sys.modules.get("torch")
    if type(data) is np.ndarray or (torch is not None and type(data) is torch.Tensor):
        return list(data)
    try:
        return list(data)
    except Exception as error:  # noqa: BLE001 - whatever the subclass's own code raises
        raise PromptTypeError(
            where, f"the {type_name(data)} cannot be split into items ({type(error).__name__}: {error})"
        ) from None


# Text or a file's raw bytes: no image, video, audio or waveform until something loads it.
_UNLOADED: Final = (str, bytes, bytearray, memoryview)


def _check_no_text(where: str, modality: str, data: object, items: Sequence[object]) -> None:
    """A str or bytes is no image, video or audio: vLLM's parser reads its characters or
    bytes as items (its renderer then refuses them) or fails; a URL or path is for the
    chat path, a file's bytes for a loader (``PIL.Image.open``)."""
    for path, value in ((where, data), *((f"{where}[{i}]", item) for i, item in enumerate(items))):
        if isinstance(value, _UNLOADED):
            what = "a str is" if isinstance(value, str) else f"raw bytes ({type_name(value)}) are"
            raise PromptTypeError(path, f"{what} not {modality} data (vLLM refuses it); load the media first")


# -- converters: plain values in, frozen values out; idempotent on frozen values --


def _check_modality(path: str, modality: object) -> str:
    if not isinstance(modality, str):
        raise PromptTypeError(path, f"modality names must be str, got {type_name(modality)}")
    modality = str.__str__(modality)  # a subclass's == or len could lie
    if not modality:
        raise InvalidPromptError(path, "modality names must not be empty")
    if modality == "model_id":  # vLLM hashes hash_kwargs(model_id=..., <modality>=item)
        raise InvalidPromptError(path, "'model_id' is not a modality name (keys hash the model id under it)")
    return check_text(path, modality)


def _check_given_once(where: str, modality: str, read: Mapping[str, object]) -> None:
    # A str subclass key (hashed and compared by identity, say) beside the plain one reads
    # as the same modality: one would silently replace the other's items.
    if modality in read:
        raise InvalidPromptError(where, "is given twice (a str subclass key reads as its text)")


def _convert_media(value: MediaDataInput | None) -> MediaData:
    if value is None:
        return _EMPTY
    if is_frozen_map(value, "media"):
        return value  # type: ignore[return-value]
    path = "$.multi_modal_data"
    if not isinstance(value, Mapping):
        raise PromptTypeError(path, f"must be a mapping of modality to items, got {type_name(value)}")
    frozen: dict[str, PVector[Any]] = {}
    for modality, data in read_entries(value, path):
        modality = _check_modality(path, modality)
        where = f"{path}.{modality}"
        _check_given_once(where, modality, frozen)
        if data is None:
            raise InvalidPromptError(
                where, "is None; give an item or a list of items (an item may be None if it has a UUID)"
            )
        if isinstance(data, EmbeddingFields):
            data = [data]  # one item of vLLM's dict form (see _embedding_fields)
        elif modality in _VISUAL_AUDIO and isinstance(data, Mapping):
            # vLLM reads a dict here as the model's embedding fields for the whole modality
            # (image_embeds with image_grid_thw, say), split into items by the model's own
            # rules; a record keeps a list of items, so it would hand vLLM another input.
            raise PromptTypeError(
                where,
                f"a dict is vLLM's form for a model's {modality} embedding fields (e.g. "
                "image_embeds with image_grid_thw), split into items by the model; "
                "records carry that form as one EmbeddingFields per item (built by the adapter's "
                "chat path from vLLM's parser), or give a list of items (embeddings as a tensor "
                "per item, where the model takes them)",
            )
        read = data
        if isinstance(data, np.ndarray) and not is_own_array(data):
            # Read once, through a private view (a subclass's as the array it carries): the
            # checks and the copy read one layout, whatever another thread sets on the
            # caller's array meanwhile. (A record's own array is read as made.)
            read = np.ndarray.view(data, np.ndarray)
        if _ndim(read) == 0:  # vLLM would iterate over it and fail
            raise PromptTypeError(where, f"a 0-d {type_name(data)} is neither an item nor a list of items")
        if _is_own_vector(data, modality):
            # A record's own items, checked and frozen (replace_media keeps them): frozen
            # again, its sealed images and tensors would be copied and keyed anew.
            frozen[modality] = data
            continue
        frozen[modality] = made_in_this_call(
            ("modality", modality, id(data)), data, _freeze_items, where, modality, read
        )
    return frozen_map(frozen, "media") if frozen else _EMPTY


def _freeze_items(where: str, modality: str, data: Any) -> PVector[Any]:
    """A modality's value as the record's checked, frozen list of items."""
    if isinstance(data, np.ndarray):  # before splitting reads its elements
        check_code_points(handout(data), where)
    # A pvector is a list of items already (a record's own); anything else is read
    # the way vLLM reads it, so single items and lists give the same record.
    # (Read through torch's own descriptor: a subclass's is_nested may raise or lie.)
    if is_torch_tensor(data) and sys.modules["torch"].Tensor.is_nested.__get__(data):  # no len(), sizes
        raise PromptTypeError(
            where, "a nested tensor is no item vLLM can split or key; give a list of tensors"
        )
    if isinstance(data, PVector):  # a list of items already: a record's own, or a loader's
        items: Sequence[Any] = read_elements(data, where)
    else:
        # Read once (a subclass's len, [i] and iteration could each say another thing):
        # split, checked and frozen, it is this read.
        read = read_elements(data, where) if isinstance(data, (list, tuple)) else data
        items = _split_items(where, modality, read)
    if modality in ("video", "audio"):
        # Their checks read into items (a pair's parts, a video's frames, a waveform's
        # channels): each container they read is read once, and frozen as read.
        items = [_read_item(f"{where}[{i}]", item, _READ_LEVELS) for i, item in enumerate(items)]
    if modality in _VISUAL_AUDIO:
        _check_no_text(where, modality, data, items)
        _check_no_numbers(where, modality, items)
        _check_item_arrays(where, modality, items, split=not isinstance(data, (list, PVector, tuple)))
    if modality == "image":
        _check_images_parse(where, items)
    if modality == "video":
        # A tuple split into items reaches the engine as a list of them, too.
        _check_video_items(where, items, given_as_items=isinstance(data, (PVector, tuple)))
    if modality == "audio":
        _check_audio_items(where, items)
    if modality not in _VISUAL_AUDIO and any(isinstance(item, EmbeddingFields) for item in items):
        raise PromptTypeError(where, "vLLM takes a dict of embedding fields only for image, video and audio")
    check_embedding_items(where, modality, list(items))
    # One caller object given twice is one frozen item: one copy, one key (``items``
    # holds each object, so no id is reused meanwhile).
    made: dict[int, Any] = {id(None): None}
    try:
        for i, item in enumerate(items):
            if id(item) not in made:
                made[id(item)] = made_in_this_call(_item_key(item), item, freeze_media, item, f"{where}[{i}]")
        # A list first: pyrsistent's C pvector() keeps a reference to each element it took
        # from an iterable that then raises, so a refused item leaked the items before it.
        vector = pvector([made[id(item)] for item in items])
        if modality == "image":  # once frozen: what a container holds is checked by then
            _check_no_image_containers(where, items, vector)
    except BaseException as error:
        # A refusal's frames keep no frozen item (and its protection) alive: not this
        # one's, nor the frames of the checks given the vector, dropped from a refusal.
        made.clear()
        vector = pvector()
        if isinstance(error, OmniRequestsError):
            raise error.with_traceback(None)  # noqa: B904 - the same error, re-raised here
        raise
    _OWN_VECTORS.put(vector, modality)
    return vector


# How deep the video and audio checks read into an item's lists and tuples: (frames,
# metadata) and its frames; (waveform, rate), its waveform's channels and their samples.
_READ_LEVELS: Final = 3
_SEQUENCES: Final = (list, tuple, PVector)


def _read_item(where: str, item: object, levels: int) -> object:
    """``item`` with its lists and tuples ``levels`` deep each read once
    (:func:`read_elements`): ``item`` itself where all are plain (built-ins cannot read one
    way and iterate another), else a copy of plain tuples and lists as read."""
    if not isinstance(item, _SEQUENCES) or is_pil_image(item) or is_torch_tensor(item):
        return item  # freezing refuses a container that is also an image or a tensor
    read = read_elements(item, where)
    if levels <= 1 or not any(issubclass(kind, _SEQUENCES) for kind in set(map(type, read))):
        return read
    parts = [_read_item(f"{where}[{j}]", part, levels - 1) for j, part in enumerate(read)]
    if all(part is before for part, before in zip(parts, read, strict=True)):
        return read
    return tuple(parts) if isinstance(read, tuple) else parts


def _item_key(item: object) -> tuple[object, ...]:
    """An item's name for reusing its frozen copy within one call (``made_in_this_call``):
    an array by its layout too, as the checks just read it, so one whose shape was set
    since an earlier dict of the call froze it is frozen again, as it was checked."""
    if isinstance(item, np.ndarray) and not is_own_array(item):  # a record's own: read as made
        return ("item", id(item), np.ndarray.dtype.__get__(item), np.ndarray.shape.__get__(item))
    return ("item", id(item))


# The item lists records froze, by identity, with their modality: a list found here holds
# a record's own items, frozen and checked for that modality.
_OWN_VECTORS: Final[IdentityMap[str]] = IdentityMap()


def _is_own_vector(value: object, modality: str) -> TypeGuard[PVector[Any]]:
    return _OWN_VECTORS.get(value) == modality


def _check_video_items(where: str, items: Sequence[object], *, given_as_items: bool) -> None:
    # The engine's dict carries a modality's items in a list, and vLLM's parser reads a
    # list of images, or of 3-D frames, as the frames of one video: such items would
    # reach the engine as another item than the record keys.
    if given_as_items and len(items) > 0 and all(_ndim(item) == 3 for item in items):
        raise PromptTypeError(
            where,
            "items that are all 3-D arrays would reach vLLM as the frames of one video; give "
            "each video as a 4-D array or a list of frames",
        )
    for i, item in enumerate(items):
        if is_pil_image(item):
            raise PromptTypeError(
                f"{where}[{i}]",
                "a single PIL image is not a video; give its frames as a list ([image] for a "
                "one-frame video), or send it under 'image'",
            )
        if isinstance(item, tuple) and len(item) != 2:  # vLLM unpacks it and fails
            raise PromptTypeError(
                f"{where}[{i}]",
                f"a tuple of {len(item)} is not a video item; give (frames, metadata), a 4-D array "
                "or a list of frames",
            )
        _check_video_frames(f"{where}[{i}]", item)
        if isinstance(item, tuple) and item[1] is not None and not isinstance(item[1], Mapping):
            # vLLM unpacks any pair as (frames, metadata): two frames in a tuple would be a
            # one-frame video, the second frame taken for its metadata (vLLM types it a dict).
            raise PromptTypeError(
                f"{where}[{i}][1]",
                f"a video's metadata must be a mapping (vLLM's video loader gives a dict) or None, "
                f"got {type_name(item[1])}; a tuple of frames is not a video: give a list of frames "
                "or a 4-D array",
            )


def _check_video_frames(where: str, video: object) -> None:
    # The model's processor counts and sizes a video's frames, and fails on numbers.
    frames, where = (video[0], f"{where}[0]") if isinstance(video, tuple) else (video, where)
    number = _number(frames)
    if number:
        raise PromptTypeError(
            where, f"{number} is not a video's frames; give a 4-D array or a list of frames"
        )
    # The frames of (frames, metadata), an array or tensor: one frame (H, W, C) or a video
    # (T, H, W, C). (Bare items were checked with the others: a 2-D tensor there is an
    # embedding.) HF's video batching drops any other, and the processor fails.
    ndim = _ndim(frames) if isinstance(video, tuple) else None
    if ndim is not None and not 3 <= ndim <= 4:
        raise PromptTypeError(
            where,
            f"a {ndim}-D {type_name(frames)} is not a video's frames (the model's processor fails on "
            "it); give (T, H, W, C), or (H, W, C) for one frame",
        )
    # Nor on a video without pixels: no frames, or frames with a side of 0.
    if _empty(frames):
        shape = _shape(frames)
        what = "a video of no frames" if shape is None else f"a video of shape {shape} has no pixels"
        raise InvalidPromptError(where, f"{what}, which vLLM's processor fails on")
    _check_numbers_dtype(where, frames, "video")
    for j, frame in enumerate(frames if isinstance(frames, (list, PVector)) else ()):
        number = _number(frame)
        if number:
            raise PromptTypeError(
                f"{where}[{j}]", f"{number} is not a video frame; give an image or a 3-D array"
            )
        ndim = _ndim(frame)
        if ndim is not None and ndim != 3:  # vLLM stacks the frames into the video's array
            raise PromptTypeError(
                f"{where}[{j}]",
                f"a {ndim}-D {type_name(frame)} is not a video frame (vLLM's processor fails on it); "
                "give each frame as an image or a 3-D array (a gray frame as (H, W, 1))",
            )
        _check_numbers_dtype(f"{where}[{j}]", frame, "video")
        shape = _no_pixels(frame)
        if shape is not None:
            raise InvalidPromptError(
                f"{where}[{j}]", f"a frame of shape {shape} has no pixels, which vLLM's processor fails on"
            )


def _empty(value: object) -> bool:
    """Whether an array, tensor or image has a side of 0, or a list holds nothing."""
    return _no_pixels(value) is not None or (isinstance(value, (list, PVector)) and not value)


def _no_pixels(value: object) -> tuple[int, ...] | None:
    """The shape of an array, tensor or image with a side of 0; None for anything else."""
    shape = _shape(value)
    return shape if shape is not None and 0 in shape else None


def _shape(value: object) -> tuple[int, ...] | None:
    """An array's or tensor's shape as numpy or torch reads it (a record's own array as
    made), a PIL image's as (height, width); None for anything else, and for a tensor or
    image whose sizes cannot be read as ints (a nested tensor, a subclass that raises or
    lies): freezing it refuses what must be refused."""
    if isinstance(value, np.ndarray):
        return _SHAPE(as_made(value))  # type: ignore[no-any-return]
    try:
        if media_kind(value) is MediaKind.TENSOR:
            return tuple(int.__index__(side) for side in value.shape)  # type: ignore[attr-defined]
        if is_pil_image(value):
            return (int.__index__(value.height), int.__index__(value.width))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - whatever a subclass's properties raise
        return None
    return None


_SHAPE: Final = np.ndarray.shape.__get__


def _check_no_image_containers(where: str, given: Sequence[object], items: Sequence[object]) -> None:
    # vLLM's parser passes a dict, or a list of numbers, on as an image; the model's
    # processor fails on it after routing, with an error that names no field. (A list of
    # images is the model's to read: Qwen2-VL's processor flattens it, LLaVA's refuses it.
    # One that is also an image or a tensor, or holds an embedding item, was refused
    # where it was frozen.)
    for i, item in enumerate(items):  # frozen: a list is a PVector, a dict a FrozenDict
        if _shape(item) is not None or isinstance(item, EmbeddingFields):
            continue
        name = "list" if isinstance(given[i], PVector) else type_name(given[i])
        pixels = _pixels_held(item) if isinstance(item, (tuple, PVector)) else None
        if isinstance(item, Mapping) or (isinstance(item, (tuple, PVector)) and pixels is None):
            raise PromptTypeError(
                f"{where}[{i}]",
                f"a {name} {'' if isinstance(item, Mapping) else 'of no image '}is not an image "
                "(vLLM's processor fails on it); give each image as an array, a tensor or a PIL image",
            )
        if pixels is False:
            raise InvalidPromptError(
                f"{where}[{i}]", f"a {name} holding an image without pixels, which vLLM's processor fails on"
            )


def _pixels_held(value: object) -> bool | None:
    """For a frozen container, at any depth: None where it holds no array, tensor or PIL
    image; else whether every one it holds has pixels (no side of 0)."""
    shape = _shape(value)
    if shape is not None:
        return 0 not in shape
    if isinstance(value, (tuple, PVector)):
        elements: Iterable[object] = value
    elif isinstance(value, Mapping):
        elements = value.values()
    else:
        return None
    found: bool | None = None
    for element in elements:
        held = _pixels_held(element)
        if held is False:
            return False
        found = found or held
    return found


def _check_images_parse(where: str, items: Sequence[object]) -> None:
    # vLLM's parser passes an image without pixels on to the model's processor, which
    # fails on it after routing, with an error that names no field; and it turns every
    # image into RGB before anything else reads it, so one it cannot turn fails there,
    # whatever key the record gave it.
    for i, item in enumerate(items):
        shape = _no_pixels(item)
        if shape is not None:
            raise InvalidPromptError(
                f"{where}[{i}]",
                f"an image of shape {shape} has no pixels, which vLLM's processor fails on",
            )
        if not is_pil_image(item):
            continue
        check_image_attributes(item, f"{where}[{i}]")  # a subclass's that raise: by name
        error = rgb_conversion_error(item)
        if error is not None:
            image: Any = item
            what = "its info['transparency']" if "transparency" in image.info else "its mode"
            raise InvalidPromptError(
                f"{where}[{i}]",
                f"vLLM's image parser cannot turn this {image.mode} image into RGB ({type(error).__name__}: "
                f"{error}); fix {what}, or convert it to RGB first",
            )


# What a list of items holds where a 1-D array, or a list of numbers, was split into items.
_NUMBERS: Final = (int, float, np.number, np.bool_)


# What each modality takes instead of a number, and why a number is none of its items.
_INSTEAD_OF_A_NUMBER: Final = {
    "image": "an image item (a 1-D array or a list of numbers splits into numbers); give each "
    "image as an array, a tensor or a PIL image",
    "video": "a video item (a 1-D array or a list of numbers splits into numbers); give each "
    "video as an array, a tensor or a list of frames",
    "audio": "an audio item (the engine's list of items would read as one waveform); give an "
    "array, a list of samples or (array, rate)",
}


def _check_no_numbers(where: str, modality: str, items: Sequence[object]) -> None:
    # A 1-D array (or a list of numbers) given as a modality's whole value splits into
    # numbers, which vLLM's parser (video) or the model's processor (image) fails on; for
    # audio, the engine's list of them reads as one waveform.
    for i, item in enumerate(items):
        number = _number(item)
        if number:
            raise PromptTypeError(f"{where}[{i}]", f"{number} is not {_INSTEAD_OF_A_NUMBER[modality]}")


def _number(item: object) -> str:
    """What names ``item`` as a number ("" for none): a 0-d array or tensor is one too
    (vLLM's parser takes it, but its processing fails on it as on a number)."""
    if isinstance(item, _NUMBERS):
        return "a number"
    return f"a 0-d {type_name(item)} (one number)" if _ndim(item) == 0 else ""


# numpy's kinds that hold no numbers: str, bytes, datetime, timedelta, structured, object.
# (An audio feature extractor may turn numeric strings, datetimes or a one-field record
# into float32 samples; records ask for numbers: see docs/vllm-parity.md.)
_NOT_NUMBERS: Final = frozenset("USMmVO")


def _check_numbers_dtype(where: str, value: object, modality: str) -> None:
    """Refuses an array of something other than numbers (or bools) as pixels, which the
    model's processor fails on after routing, or as samples, which one model's feature
    extractor reads (numeric text, dates) and another fails on."""
    if isinstance(value, np.ndarray):
        dtype = np.ndarray.dtype.__get__(as_made(value))
        if dtype.kind in _NOT_NUMBERS:
            why = (
                "samples (a feature extractor may read numeric text or dates, another fails on them)"
                if modality == "audio"
                else "pixels (vLLM's processor fails on it)"
            )
            raise PromptTypeError(
                where, f"an array of dtype {dtype} holds no {why}; give an array of numbers"
            )


# The most dimensions an array or tensor item may have: an image (H, W, C), or a batch of
# them the model's processor flattens (N, H, W, C); a video (T, H, W, C); a waveform of
# channels (C, samples). The model's processor (HF's video batching drops a 5-D video) or
# vLLM's audio normalisation fails on more, naming no field.
_MOST_DIMS: Final = {"image": 4, "video": 4, "audio": 2}

# What each modality takes instead of an item of too many dimensions.
_INSTEAD_OF_MORE_DIMS: Final = {
    "image": "an image (give (H, W, C), or (N, H, W, C) for N images)",
    "video": "a video (give (T, H, W, C), one video per item)",
    "audio": "a waveform (give samples, 1-D, or channels of samples, 2-D)",
}


def _check_item_arrays(where: str, modality: str, items: Sequence[object], *, split: bool) -> None:
    """Refuses array and tensor items the model's processor can only fail on: an image or
    video with too few dimensions, any item with too many, and arrays of no numbers.
    ``split``: the items are the elements of one array or tensor vLLM's parser splits (a
    2-D image array into its rows)."""
    if not split and items and media_kind(items[0]) is MediaKind.TENSOR and _ndim(items[0]) == 2:
        # vLLM's parser reads a list whose first item is a 2-D tensor as the modality's
        # embeddings, one per item, and refuses the list if any other item is not 2-D.
        for i, item in enumerate(items[1:], 1):
            ndim = _ndim(item)
            if ndim != 2:
                kind = type_name(item) if ndim is None else f"{ndim}-D {type_name(item)}"
                raise PromptTypeError(
                    f"{where}[{i}]",
                    f"is a {kind} where item [0] is a 2-D tensor: vLLM's parser reads the list as "
                    f"{modality} embeddings, each 2-D (seq_len, hidden_size)",
                )
    for i, item in enumerate(items):
        ndim = _ndim(item)
        if ndim is None:
            continue
        _check_numbers_dtype(f"{where}[{i}]", item, modality)
        # A 2-D tensor in a list is an embedding to vLLM's parser; a 2-D array never is.
        array = isinstance(item, np.ndarray)
        if ndim > _MOST_DIMS[modality]:
            raise PromptTypeError(
                f"{where}[{i}]",
                f"a {ndim}-D {type_name(item)} is not {_INSTEAD_OF_MORE_DIMS[modality]}"
                f"{_split_from(ndim, array, split)}; the model's processor fails on it",
            )
        if modality in ("image", "video") and ndim < (3 if array else 2):
            whole = _split_from(ndim, array, split)
            one = (
                "an image (a gray one as (H, W, 1) or a PIL image)"
                if modality == "image"
                else ("a video (frames as (T, H, W, C), a gray one as (T, H, W, 1))")
            )
            raise PromptTypeError(
                f"{where}[{i}]",
                f"a {ndim}-D {type_name(item)} is not {one}{whole}; the model's processor fails on it",
            )


def _split_from(ndim: int, array: bool, split: bool) -> str:
    """How an item of ``ndim`` dimensions came to be, where vLLM's parser split it from the
    modality's whole value ("" where it was given as an item)."""
    kind = "array" if array else "tensor"
    return f"; vLLM reads a {ndim + 1}-D {kind} given whole as a list of them" if split else ""


def _waveform_like(value: object) -> bool:
    """An array, tensor or sequence of samples: what a model's feature extractor may read
    as the waveform of ``(waveform, rate)`` (None, a dict or an image it cannot)."""
    if isinstance(value, (np.ndarray, list, tuple, PVector, EmbeddingFields)):
        return True
    return media_kind(value) is MediaKind.TENSOR


def _check_audio_items(where: str, items: Sequence[object]) -> None:
    # After _check_no_numbers: no item is a number.
    for i, item in enumerate(items):
        if (isinstance(item, Mapping) and not isinstance(item, EmbeddingFields)) or is_pil_image(item):
            raise PromptTypeError(
                f"{where}[{i}]",
                f"a {type_name(item)} is not an audio item (vLLM's parser fails on it); give an "
                "array, a list of samples or (array, rate)",
            )
        if isinstance(item, tuple):  # vLLM unpacks (waveform, rate): other lengths fail there
            if len(item) != 2:
                raise PromptTypeError(
                    f"{where}[{i}]", f"a tuple of {len(item)} is not an audio item; give (waveform, rate)"
                )
            if isinstance(item[0], _UNLOADED):
                raise PromptTypeError(
                    f"{where}[{i}]",
                    f"a {type_name(item[0])} is not a waveform (vLLM's processor refuses it); "
                    "load the audio first",
                )
            number = _number(item[0])
            if number:
                raise PromptTypeError(
                    f"{where}[{i}][0]", f"{number} is not a waveform; give an array of samples"
                )
            if not _waveform_like(item[0]):  # a list of samples is the model's to read (some take it)
                raise PromptTypeError(
                    f"{where}[{i}][0]",
                    f"a {type_name(item[0])} is not a waveform in (waveform, rate) (vLLM's parser "
                    "fails on it); give an array of samples",
                )
            _check_numbers_dtype(f"{where}[{i}][0]", item[0], "audio")
            ndim = _ndim(item[0])
            if ndim is not None and ndim > _MOST_DIMS["audio"]:  # vLLM's normalisation fails on it
                raise PromptTypeError(
                    f"{where}[{i}][0]",
                    f"a {ndim}-D {type_name(item[0])} is not {_INSTEAD_OF_MORE_DIMS['audio']}; "
                    "the model's processor fails on it",
                )
            _check_sample_rate(f"{where}[{i}][1]", item[1])
        waveform, at = (item[0], f"{where}[{i}][0]") if isinstance(item, tuple) else (item, f"{where}[{i}]")
        if isinstance(waveform, (list, tuple, PVector)):
            _check_samples(at, waveform)  # empty ones too
        # vLLM's processor fails on a waveform without samples (and the model decides how
        # few it takes: Qwen2-Audio's refuses one sample too).
        elif (shape := _no_pixels(waveform)) is not None:
            raise InvalidPromptError(
                at, f"a waveform of shape {shape} has no samples, which vLLM's processor fails on"
            )


# What a waveform given as a list holds, as vLLM's parser makes an array of it (np.array):
# samples (numbers, 0-d arrays or tensors), or channels of equal length (lists of samples,
# 1-D arrays or tensors). Anything else the model's feature extractor fails on.
_SAMPLES: Final = (int, float, np.integer, np.floating, np.bool_)


def _read_list(where: str, values: Sequence[object]) -> list[object]:
    try:
        return list(values)
    except Exception as error:  # noqa: BLE001 - whatever a list subclass's own code raises
        raise PromptTypeError(
            where, f"its samples cannot be read ({type(error).__name__}: {error})"
        ) from None


def _numbers(value: object, ndim: int) -> bool:
    """An array or tensor of ``ndim`` dimensions that holds numbers numpy can read."""
    if _ndim(value) != ndim:
        return False
    if isinstance(value, np.ndarray):
        return np.ndarray.dtype.__get__(as_made(value)).kind not in _NOT_NUMBERS
    try:  # a tensor, as np.array reads it: a bfloat16 one, one needing grad or on a GPU fail
        return np.asarray(value).dtype.kind not in _NOT_NUMBERS
    except Exception:  # noqa: BLE001 - whatever the tensor's __array__ raises
        return False


def _is_sample(value: object) -> bool:
    return isinstance(value, _SAMPLES) or _numbers(value, 0)


def _not_a_sample(where: str, value: object) -> PromptTypeError:
    return PromptTypeError(
        where,
        f"a {type_name(value)} is not a sample; a waveform given as a list holds numbers numpy can "
        "read (vLLM's parser makes an array of it), or one list or 1-D array of them per channel",
    )


def _check_samples(where: str, waveform: Sequence[object]) -> None:
    """Refuses a waveform given as a list (or tuple) that vLLM's parser cannot make an
    array of numbers of: the model's feature extractor fails on it after routing."""
    samples = _read_list(where, waveform)
    if not samples:
        raise InvalidPromptError(where, "an empty list of samples, which vLLM's processor fails on")
    if _is_sample(samples[0]):
        j = next((j for j, sample in enumerate(samples) if not _is_sample(sample)), None)
        if j is None:
            return
        if isinstance(samples[j], (list, tuple, PVector)) or _numbers(samples[j], 1):
            raise PromptTypeError(
                f"{where}[{j}]", "a channel beside samples; give samples, or one list of them per channel"
            )
        raise _not_a_sample(f"{where}[{j}]", samples[j])
    lengths: list[int] = []
    for j, channel in enumerate(samples):
        at = f"{where}[{j}]"
        if isinstance(channel, (list, tuple, PVector)):
            values = _read_list(at, channel)
            for k, sample in enumerate(values):
                if not _is_sample(sample):
                    raise _not_a_sample(f"{at}[{k}]", sample)
            length = len(values)
        elif _numbers(channel, 1):
            length = _shape(channel)[0]  # type: ignore[index]
        elif _is_sample(channel):
            raise PromptTypeError(
                at, "a sample beside channels; give samples, or one list of them per channel"
            )
        else:
            raise _not_a_sample(at, channel)
        if lengths and length != lengths[0]:
            raise InvalidPromptError(
                at, f"a channel of {length} samples beside one of {lengths[0]}; channels are of equal length"
            )
        lengths.append(length)
    if not lengths[0]:
        raise InvalidPromptError(where, "channels of no samples, which vLLM's processor fails on")


# A sample rate: vLLM resamples the waveform from it to the model's rate (None: as it is).
_RATES: Final = (int, float, np.integer, np.floating)


def _check_sample_rate(where: str, rate: object) -> None:
    """Refuses what vLLM's resampling fails on (a rate that rounds to 0 or below, NaN,
    infinite: with no field named) or reads by accident (a str it compares as
    float(rate), a bool as 1 Hz, a timedelta)."""
    if rate is None:
        return
    if isinstance(rate, (bool, np.timedelta64)) or not isinstance(rate, _RATES):
        raise PromptTypeError(
            where, f"a sample rate must be a number of samples per second, or None; got {type_name(rate)}"
        )
    # Read as the built-in value: a subclass's own comparisons could lie, and a numpy
    # scalar subclass's conversion could raise.
    try:
        if isinstance(rate, int):
            value: float = int.__int__(rate)
        else:
            value = float.__float__(rate) if isinstance(rate, float) else float(rate)
    except (TypeError, ValueError, OverflowError) as error:
        raise PromptTypeError(
            where,
            f"a sample rate must be a number of samples per second; this {type_name(rate)} "
            f"cannot be read as one ({type(error).__name__}: {error})",
        ) from None
    # vLLM's resamplers read the rate as int(round(rate)): 0.5 resamples from 0 Hz.
    if not (0.0 < value < math.inf and round(value) >= 1):  # NaN fails the first
        raise InvalidPromptError(
            where, f"a sample rate must be finite and at least 1 once rounded, got {rate!r}"
        )


def _convert_uuids(value: MediaUUIDsInput | None) -> MediaUUIDs:
    if value is None:
        return _EMPTY
    if is_frozen_map(value, "uuids"):
        return value  # type: ignore[return-value]
    path = "$.multi_modal_uuids"
    if not isinstance(value, Mapping):
        raise PromptTypeError(path, f"must be a mapping of modality to UUIDs, got {type_name(value)}")
    frozen: dict[str, PVector[str | None]] = {}
    for modality, uuids in read_entries(value, path):
        modality = _check_modality(path, modality)
        where = f"{path}.{modality}"
        _check_given_once(where, modality, frozen)
        if uuids is None:
            continue  # vLLM reads a None row as no UUIDs: each item is keyed by its content
        if isinstance(uuids, str):
            uuids = [uuids]
        elif not isinstance(uuids, (list, tuple, PVector)):
            raise PromptTypeError(where, f"must be a str or a list of str or None, got {type_name(uuids)}")
        row = read_elements(uuids, where)
        frozen[modality] = pvector([check_uuid(f"{where}[{i}]", uuid) for i, uuid in enumerate(row)])
    return frozen_map(frozen, "uuids") if frozen else _EMPTY


def refuse_engine_scoped(path: str, uuid: str) -> None:
    """Refuses ``uuid`` when it is already scoped to a replica (``stage0:rep1:...``)."""
    if looks_scoped(uuid):
        raise InvalidPromptError(
            path,
            f"{uuid!r} is already scoped to a replica, so this prompt has been through an "
            "engine; rebuild it from the original prompt instead of reusing the engine's copy",
        )


def check_uuid(path: str, uuid: object) -> str | None:
    """``uuid`` as a record keeps it (a plain str, or None), or our error naming ``path``:
    not a str, empty, engine-scoped, a policy's prefix, or text no key can hold."""
    if uuid is None:
        return None
    if not isinstance(uuid, str):
        raise PromptTypeError(path, f"must be a str or None, got {type_name(uuid)}")
    uuid = str.__str__(uuid)  # checked as the plain text the key is made of, not a subclass's view
    if not uuid:
        raise InvalidPromptError(path, "must not be empty: every item needs its own key")
    refuse_engine_scoped(path, uuid)
    prefix = reserved_prefix(uuid)
    if prefix is not None:
        raise InvalidPromptError(
            path,
            f"{uuid!r} starts with {prefix!r}, which key policies put before tenants' and "
            "namespaced keys; a UUID may not spell one (use another prefix)",
        )
    return check_text(path, uuid)


# The option maps records froze: one given again (attrs.evolve, replace_media, a field
# passed on) is a record's own, checked and frozen, and is kept as it is. Frozen again, an
# array in it whose layout its holder set in place would be refused, in a call that was
# not given it; kept, the record reads it as made, as the one it came from does.
_OWN_OPTIONS: Final[IdentityMap[bool]] = IdentityMap()


def _as_options(path: str, value: object) -> FrozenDict[str, Any] | None:
    if value is None:
        return None
    if _OWN_OPTIONS.get(value):
        return value  # type: ignore[return-value]
    if not isinstance(value, Mapping):
        raise PromptTypeError(path, f"must be a mapping, got {type_name(value)}")
    frozen: FrozenDict[str, Any] = freeze_option(value, path)  # type: ignore[assignment]
    _OWN_OPTIONS.put(frozen, True)
    return frozen


def _as_option_list(path: str, value: object) -> Any:
    if value is None:
        return None
    if not isinstance(value, (list, tuple, PVector)):
        raise PromptTypeError(path, f"must be a list, got {type_name(value)}")
    return freeze_option(value, path)


def _convert_media_io(value: Mapping[str, Options] | None) -> FrozenDict[str, Any] | None:
    path = "$.media_io_kwargs"
    frozen = _as_options(path, value)
    for modality, kwargs in (frozen or {}).items():
        if not isinstance(kwargs, Mapping):
            raise PromptTypeError(f"{path}.{modality}", f"must be a mapping, got {type_name(kwargs)}")
    return frozen


# A token id is an index into the vocabulary: vLLM refuses a negative one (and one past
# its vocabulary), and holds them as int64.
_MAX_TOKEN_ID: Final = (1 << 63) - 1
_PVECTOR: Final[type[Any]] = type(pvector())  # a record's own; a registered look-alike is not one


def _as_token_ids(path: str, value: object) -> PVector[int]:
    if type(value) is _PVECTOR:
        own: PVector[Any] = value  # type: ignore[assignment]
        if all(type(v) is int and 0 <= v <= _MAX_TOKEN_ID for v in own):
            return own  # a record's own (or as good as one)
    if isinstance(value, (bytes, bytearray, memoryview)) or (
        isinstance(value, array.array) and value.typecode in "bB"
    ):
        # Sequences of ints to Python, but raw bytes to a caller: an encoded text or a
        # buffer is no list of token ids, whichever of these holds it.
        raise PromptTypeError(path, f"must be a list of int, got raw bytes ({type_name(value)})")
    if (
        isinstance(value, str)
        or not isinstance(value, (Sequence, np.ndarray, PVector))
        or (isinstance(value, np.ndarray) and _ndim(value) != 1)
    ):
        raise PromptTypeError(path, f"must be a list of int, got {type_name(value)}")
    if isinstance(value, np.ndarray):  # before reading its elements
        # As numpy holds it (a private view): a subclass's own code is never run.
        plain: np.ndarray[Any, Any] = np.ndarray.view(as_made(value), np.ndarray)
        check_code_points(plain, path)
        tokens: Sequence[Any] = plain  # type: ignore[assignment]
    else:
        tokens = read_elements(value, path)  # once: checked and kept as read
    ids = []
    for i, token in enumerate(tokens):
        if isinstance(token, bool):
            raise PromptTypeError(f"{path}[{i}]", "must be an int, got bool")
        try:
            token_id = operator.index(token)
        except TypeError:
            raise PromptTypeError(f"{path}[{i}]", f"must be an int, got {type_name(token)}") from None
        except Exception as error:  # noqa: BLE001 - an int subclass's own __index__
            raise PromptTypeError(
                f"{path}[{i}]",
                f"this {type_name(token)} cannot be read as an int ({type(error).__name__}: {error})",
            ) from None
        if not 0 <= token_id <= _MAX_TOKEN_ID:
            raise InvalidPromptError(
                f"{path}[{i}]", f"must be a token id between 0 and 2**63 - 1 (vLLM's int64), got {token_id}"
            )
        ids.append(token_id)
    return pvector(ids)


def _as_text(path: str, value: object) -> str:
    if not isinstance(value, str):
        raise PromptTypeError(path, f"must be a str, got {type_name(value)}")
    return check_text(path, str.__str__(value))


def _as_embeds(path: str, value: object, *, allow_list: bool = False) -> Any:
    if is_torch_tensor(value):
        return value
    if allow_list and isinstance(value, (list, tuple, PVector)):
        tensors = read_elements(value, path)  # once: checked and kept as read
        for i, tensor in enumerate(tensors):
            if not is_torch_tensor(tensor):
                raise PromptTypeError(f"{path}[{i}]", f"must be a torch.Tensor, got {type_name(tensor)}")
        return pvector(tensors)
    expected = "a torch.Tensor or a list of them" if allow_list else "a torch.Tensor"
    raise PromptTypeError(path, f"must be {expected}, got {type_name(value)}")


# Named converters, one per field: attrs' mypy plugin reads their argument types.


def _prompt(value: str) -> str:
    return _as_text("$.prompt", value)


def _optional_prompt(value: str | None) -> str | None:
    return None if value is None else _as_text("$.prompt", value)


def _negative_prompt(value: str | None) -> str | None:
    return None if value is None else _as_text("$.negative_prompt", value)


def _cache_salt(value: str | None) -> str | None:
    return None if value is None else _as_text("$.cache_salt", value)


def _prompt_token_ids(value: TokenIds) -> PVector[int]:
    return _as_token_ids("$.prompt_token_ids", value)


def _optional_prompt_token_ids(value: TokenIds | None) -> PVector[int] | None:
    return None if value is None else _as_token_ids("$.prompt_token_ids", value)


def _token_type_ids(value: TokenIds | None) -> PVector[int] | None:
    return None if value is None else _as_token_ids("$.token_type_ids", value)


def _prompt_token_offsets(value: Sequence[tuple[int, int]] | None) -> Any:
    return _as_option_list("$.prompt_token_offsets", value)


def _prompt_is_token_ids(value: Sequence[bool] | None) -> PVector[bool] | None:
    path = "$.prompt_is_token_ids"
    if value is None:
        return None
    if not isinstance(value, (list, tuple, PVector)):
        raise PromptTypeError(path, f"must be a list of bool, got {type_name(value)}")
    flags = read_elements(value, path)  # once: checked and kept as read
    for i, flag in enumerate(flags):
        if not isinstance(flag, bool):
            raise PromptTypeError(f"{path}[{i}]", f"must be a bool, got {type_name(flag)}")
    return pvector(flags)


def fits_embeds_prompt(value: object) -> bool:
    """Whether ``value`` is no tensor, or a tensor of a shape vLLM's renderer reads as an
    embeds prompt: ``(seq_len, hidden_size)`` or ``(1, seq_len, hidden_size)``."""
    if not is_torch_tensor(value):
        return True
    shape = _shape(value)
    return shape is not None and (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1))


def _prompt_embeds(value: torch.Tensor) -> Any:
    embeds = _as_embeds("$.prompt_embeds", value)
    if not fits_embeds_prompt(embeds):
        shape = _shape(embeds)
        got = "sizes that cannot be read" if shape is None else str(shape)
        raise InvalidPromptError(
            "$.prompt_embeds",
            f"must be of shape (seq_len, hidden_size) or (1, seq_len, hidden_size), got {got}",
        )
    # vLLM's renderer reads its ndim (a subclass's may raise or lie) and copies it to the CPU.
    check_tensor_dims(embeds, "$.prompt_embeds")
    check_values_held(embeds, "$.prompt_embeds")
    return embeds


def _optional_prompt_embeds(value: torch.Tensor | None) -> Any:
    return None if value is None else _as_embeds("$.prompt_embeds", value)


def _negative_prompt_embeds(value: torch.Tensor | None) -> Any:
    return None if value is None else _as_embeds("$.negative_prompt_embeds", value)


def _negative_prompt_embeds_list(value: torch.Tensor | Sequence[torch.Tensor] | None) -> Any:
    return None if value is None else _as_embeds("$.negative_prompt_embeds", value, allow_list=True)


def _mm_processor_kwargs(value: Options | None) -> FrozenDict[str, Any] | None:
    return _as_options("$.mm_processor_kwargs", value)


def _additional_information(value: Options | None) -> FrozenDict[str, Any] | None:
    return _as_options("$.additional_information", value)


def _model_intermediate_buffer(value: Options | None) -> FrozenDict[str, Any] | None:
    return _as_options("$.model_intermediate_buffer", value)


def _modalities(value: StrList | None) -> PVector[str] | None:
    path = "$.modalities"
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, PVector)):
        raise PromptTypeError(path, f"must be a list of str, got {type_name(value)}")
    names = []
    for i, name in enumerate(read_elements(value, path)):
        if not isinstance(name, str):
            raise PromptTypeError(f"{path}[{i}]", f"must be a str, got {type_name(name)}")
        names.append(check_text(f"{path}[{i}]", str.__str__(name)))
    return pvector(names)


def _check_scope(_: object, attribute: attrs.Attribute[Scope | None], value: object) -> None:
    if value is not None and not isinstance(value, Scope):
        raise PromptTypeError(f"$.{attribute.name}", f"must be a Scope or None, got {type_name(value)}")


# -- equality: media compares by content, never by numpy's elementwise == --


def values_equal(a: Any, b: Any, depth: int = 0) -> bool:
    """Deep equality that treats arrays, tensors and images as values."""
    if a is b:
        return True
    if depth > MAX_DEPTH:  # an option's object array holding itself, say: no end to walk
        return False
    kind = media_kind(a)
    if kind is not media_kind(b):
        return False
    if kind is MediaKind.IMAGE or kind is MediaKind.TENSOR:
        a, b = current(a), current(b)  # a record's view: the bytes it sealed
    if kind is MediaKind.ARRAY:
        if type(a) is np.ndarray and type(b) is np.ndarray:
            a, b = handout(a), handout(b)  # a record's own array: as made, as it keys and sends it
        if a.dtype.hasobject or b.dtype.hasobject:  # options only: its bytes are pointers
            # as Python values, structured fields too (an element is an np.void of pointers)
            return (
                a.dtype == b.dtype and a.shape == b.shape and values_equal(a.tolist(), b.tolist(), depth + 1)
            )
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    if kind is MediaKind.TENSOR:
        # By bytes, like arrays and like the hasher: NaN equals itself, -0.0 differs from 0.0.
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(tensor_bytes(a), tensor_bytes(b)))
        )
    if kind is MediaKind.IMAGE:
        return (
            (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
            # as the key reads the palette, and as converting to RGB (the content key) does
            and palette_state(a) == palette_state(b)
            # vLLM keys an image with an EXIF ImageID by that UUID, and its parser turns it
            # by its orientation and flattens its transparency: equal records, equal keys.
            and _exif_image_id(a) == _exif_image_id(b)
            and _parsed_as(a) == _parsed_as(b)
        )
    if kind is MediaKind.SEQUENCE:
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(values_equal(x, y, depth + 1) for x, y in zip(a, b, strict=True))
        )
    if kind is MediaKind.MAPPING:
        if isinstance(a, EmbeddingFields) or isinstance(b, EmbeddingFields):
            return bool(a == b)  # fields and layout; never equal to a plain mapping
        if isinstance(a, FrozenDict):
            # Ordered, as vLLM hashes it: the same entries in another order make another key.
            return (
                isinstance(b, FrozenDict)
                and list(a) == list(b)
                and all(values_equal(a[k], b[k], depth + 1) for k in a)
            )
        return a.keys() == b.keys() and all(values_equal(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, np.generic):  # by bytes, as the hash sees them: -0.0 is not 0.0
        return type(a) is type(b) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return type(b) is float and np.array(a).tobytes() == np.array(b).tobytes()
    if type(a) in (bool, int, str, bytes):  # typed, as the content key reads them: 1 is not True
        return type(a) is type(b) and a == b
    return same_value(a, b)  # an option's own ==, where one that raises means "not equal"


_media_eq = attrs.cmp_using(eq=values_equal)


def _summary(value: object) -> str:
    """A short description of a media value, so records print in a line, not megabytes."""
    kind = media_kind(value)
    if kind is MediaKind.ARRAY or kind is MediaKind.TENSOR:
        if type(value) is np.ndarray:
            value = handout(value)  # a record's own array: as made, as it sends it
        shape = "x".join(str(n) for n in value.shape)  # type: ignore[attr-defined]
        return f"{type(value).__name__}({value.dtype}, {shape or 'scalar'})"  # type: ignore[attr-defined]
    if kind is MediaKind.IMAGE:
        return f"Image({value.mode}, {value.size[0]}x{value.size[1]})"  # type: ignore[attr-defined]
    if kind is MediaKind.SEQUENCE:
        if isinstance(value, tuple):
            return "(" + ", ".join(_summary(v) for v in value) + ("," if len(value) == 1 else "") + ")"
        return "[" + ", ".join(_summary(v) for v in value) + "]"  # type: ignore[attr-defined]
    if isinstance(value, EmbeddingFields):
        return repr(value)
    if kind is MediaKind.MAPPING:
        return "{" + ", ".join(f"{k!r}: {_summary(v)}" for k, v in value.items()) + "}"  # type: ignore[attr-defined]
    return repr(value)


# -- the records --


MediaRow: TypeAlias = "tuple[str, tuple[Any, ...] | None, tuple[str | None, ...] | None]"
"""One modality of a record's media: its name, its items (None where it has UUIDs alone,
cached-only items) and its UUIDs (None where none were given)."""


def media_view(data: Mapping[str, Any], uuids: Mapping[str, Any]) -> tuple[MediaRow, ...]:
    """The rows of a record's media: the data's modalities, then those with UUIDs alone,
    each in the order the caller gave them (the order the engine's dict gets)."""
    rows: list[MediaRow] = [
        (m, tuple(items), None if (given := uuids.get(m)) is None else tuple(given))
        for m, items in data.items()
    ]
    rows += [(m, None, tuple(given)) for m, given in uuids.items() if m not in data]
    return tuple(rows)


def check_bindable(view: tuple[MediaRow, ...]) -> None:
    """Content binding needs every user-keyed item present: a cached-only one has no content."""
    for modality, items, given in view:
        for i, uuid in enumerate(given or ()):
            if uuid is not None and (items is None or items[i] is None):
                raise InvalidPromptError(
                    # A modality with UUIDs alone has no data field to name.
                    f"$.multi_modal_{'uuids' if items is None else 'data'}.{modality}[{i}]",
                    f"the policy binds UUID {uuid!r} to its item's content, but the item is not "
                    "sent (cached only); send the item or scope without bind_content",
                )


class _Derived:
    """Slots for what a record derives from its fields, outside attrs: not fields, so not
    compared, printed or pickled.

    ``_view`` holds the media as :data:`MediaRow` tuples, which the render path walks
    without reading a ``PMap`` (Python code) or a dict per modality. ``_memo`` holds
    values derived from the fields, shared with the record's scoped copies: a template
    and the copies :func:`scope_to_replica` makes of it differ only in ``scope``, so an
    entry must depend on nothing but the other fields, or be keyed by the scope. Every
    other copy starts a fresh memo (field_copier).
    """

    __slots__ = ("_memo", "_view")
    _memo: dict[Any, Any]
    _view: tuple[MediaRow, ...]


@attrs.frozen(kw_only=True, getstate_setstate=False)
class _Prompt(_Derived):
    """Fields every single prompt shares (vLLM's ``_PromptOptions`` plus vllm-omni's)."""

    multi_modal_data: MediaData = attrs.field(
        converter=_convert_media, default=_EMPTY, eq=_media_eq, hash=False, repr=_summary
    )
    """Media per modality, each a ``PVector`` of frozen items."""
    multi_modal_uuids: MediaUUIDs = attrs.field(converter=_convert_uuids, default=_EMPTY)
    """The caller's UUIDs per modality (``None`` where the content decides the key)."""
    mm_processor_kwargs: FrozenDict[str, Any] | None = attrs.field(
        converter=_mm_processor_kwargs, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    media_io_kwargs: FrozenDict[str, Any] | None = attrs.field(
        converter=_convert_media_io, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    cache_salt: str | None = attrs.field(default=None, converter=_cache_salt)
    additional_information: FrozenDict[str, Any] | None = attrs.field(
        converter=_additional_information, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    """vllm-omni's stage payload; frozen, so a later stage cannot write into the caller's."""
    model_intermediate_buffer: FrozenDict[str, Any] | None = attrs.field(
        converter=_model_intermediate_buffer, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    """vllm-omni's runner-owned stage payload (>= 0.30); frozen like ``additional_information``."""
    scope: Scope | None = attrs.field(default=None, validator=_check_scope)
    """The replica this prompt is routed to; set by :func:`scope_to_replica`."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (_rebuild, (type(self), plain_fields(self)))

    def __getstate__(self) -> dict[str, Any]:
        # The fields as __reduce__ gives them; never the memo, which scoped copies share.
        # No __setstate__: a built record is never loaded over (attrs would make one).
        return plain_fields(self)

    def __copy__(self) -> Self:
        # Immutable, as a tuple is: its copy is itself. copy.copy would otherwise hand
        # __reduce__'s pickle-only wrappers to the constructor (vllm-omni copies prompts).
        return self

    def __attrs_pre_init__(self) -> None:
        refuse_second_init(self, "_view")  # set last by every road that builds a record

    def __attrs_post_init__(self) -> None:
        data, uuids = plain_map(self.multi_modal_data), plain_map(self.multi_modal_uuids)
        for modality, items in data.items():
            given = uuids.get(modality)
            if given is not None and len(given) != len(items):
                raise InvalidPromptError(
                    f"$.multi_modal_uuids.{modality}",
                    f"If given, multi_modal_uuids[{modality!r}] must have same length as "
                    f"multi_modal_data[{modality!r}], but got {len(given)} vs {len(items)}.",
                )
            for i, item in enumerate(items):
                if item is None and (given is None or given[i] is None):
                    raise InvalidPromptError(
                        f"$.multi_modal_uuids.{modality}[{i}]",
                        f"multi_modal_data[{modality!r}][{i}] is empty but "
                        f"multi_modal_uuids[{modality!r}][{i}] is missing.",
                    )
        view = media_view(data, uuids)
        if uuids:
            _check_one_item_per_uuid(view, options=_options(self))
            _check_uuids_name_their_items(self.multi_modal_uuids, view)
            if self.scope is not None and self.scope.policy.bind_content:
                check_bindable(view)  # a copy of a bound record (replace_media, evolve) too
        object.__setattr__(self, "_view", view)
        object.__setattr__(self, "_memo", {})

    def replace_media(
        self, multi_modal_data: Mapping[str, Any], multi_modal_uuids: Mapping[str, Any] | None = None
    ) -> Self:
        """A copy with the media of the modalities named in ``multi_modal_data`` replaced.

        The way to make a request from a template: other modalities and fields are kept,
        and the replaced modalities' UUIDs are dropped, so their new items are keyed by
        content, unless ``multi_modal_uuids`` names new ones. A modality given as None is
        removed with its UUIDs. (``attrs.evolve`` with new media would keep the old UUIDs
        for the new items; records refuse that: see "Templates and copies" in the guide.)

        >>> import numpy as np
        >>> template = TextPrompt(prompt="<image>", multi_modal_data={"image": np.zeros((2, 2, 3), np.uint8)},
        ...                       multi_modal_uuids={"image": "cat-1"})
        >>> copy = template.replace_media({"image": np.ones((2, 2, 3), np.uint8)})
        >>> dict(copy.multi_modal_uuids), template.multi_modal_uuids["image"][0]
        ({}, 'cat-1')
        """
        if not isinstance(multi_modal_data, Mapping):
            raise PromptTypeError(
                "$.multi_modal_data",
                f"must be a mapping of modality to items, got {type_name(multi_modal_data)}",
            )
        data: dict[Any, Any] = dict(plain_map(self.multi_modal_data))
        uuids: dict[Any, Any] = dict(plain_map(self.multi_modal_uuids))
        for modality, items in read_entries(multi_modal_data, "$.multi_modal_data"):
            uuids.pop(modality, None)
            if items is None:
                data.pop(modality, None)
            else:
                data[modality] = items
        if multi_modal_uuids is not None:
            if not isinstance(multi_modal_uuids, Mapping):
                raise PromptTypeError(
                    "$.multi_modal_uuids",
                    f"must be a mapping of modality to UUIDs, got {type_name(multi_modal_uuids)}",
                )
            uuids.update(read_entries(multi_modal_uuids, "$.multi_modal_uuids"))
        made = attrs.evolve(self, multi_modal_data=data, multi_modal_uuids=uuids)
        if multi_modal_uuids is not None and _UUID_PAIRS.get(multi_modal_uuids) is not None:
            # A record's own map (template.multi_modal_uuids) names that record's items, as
            # it does given to the constructor or attrs.evolve: merged into a new dict
            # above, it is checked here against the items its UUIDs now name.
            _check_uuids_name_their_items(
                multi_modal_uuids,  # type: ignore[arg-type]  # a record's map: a PMap
                tuple(row for row in made._view if row[0] in multi_modal_uuids),
            )
        return made


# The items each record's UUID map was first given with, by the map's identity, so a map
# taken from one record (attrs.evolve keeps it) cannot key another record's new items.
_UUID_PAIRS: Final[IdentityMap[tuple[tuple[str, tuple[Any, ...] | None], ...]]] = IdentityMap()


# Keys media as vLLM's parser sees them, to tell whether two items are the same media.
_SAME_MEDIA: Final = MediaHasher("omni-requests: same media?")


def _same_media(modality: str, a: object, b: object) -> bool:
    """The same object, or media vLLM would key alike (an image turned by EXIF orientation
    or flattened another way is other media, and ``-0.0`` is not ``0.0``)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return _SAME_MEDIA._content_key(modality, a) == _SAME_MEDIA._content_key(modality, b)


# A prompt's processor and media-io options.
_Options = tuple[FrozenDict[str, Any] | None, FrozenDict[str, Any] | None]


# The options vLLM reads a modality's own processor options under (its hash factors).
_OWN_PROCESSOR_OPTIONS: Final = {"image": "images_kwargs", "video": "videos_kwargs", "audio": "audio_kwargs"}


def _rehashes_uuids(modality: str, options: _Options) -> bool:
    """Whether vLLM keys a UUID of ``modality`` by a hash of the UUID, the modality's name
    and the prompt's options that concern it, rather than by the UUID as it is.

    Its rule (the same in vLLM 0.30, 0.32 and 0.34, read and run by a review, helper-86):
    the modality's ``media_io_kwargs`` entry, if not empty, and every processor option
    that is no other modality's own (``images_kwargs``, ...), whatever its value. Only the
    prompt's options count: the engine's are merged after keying.
    """
    processor, media_io = options
    if media_io is not None and media_io.get(modality):
        return True
    if not processor:
        return False
    own = _OWN_PROCESSOR_OPTIONS.get(modality)
    if own is None:  # a modality with no options of its own: every option counts
        return True
    others = _OWN_PROCESSOR_OPTIONS.values()
    return any(name == own or name not in others for name in processor)


def _options(prompt: Any) -> _Options:
    return prompt.mm_processor_kwargs, prompt.media_io_kwargs


# Per UUID, per modality: where the UUID first names an item, and the first item it sends
# under it (None while it names only cached-only items).
_Named = dict[str, dict[str, tuple[str, object]]]


def _check_one_item_per_uuid(
    view: tuple[MediaRow, ...],
    named: _Named | None = None,
    part: str = "",
    options: _Options = (None, None),
) -> _Named:
    """Refuse a UUID that names two different items of one record (or pair: ``named``
    from its encoder part, ``part`` the path of the part checked); returns ``named``.

    vLLM takes a UUID as the item's cache key as it is, whatever its modality: two items
    under one UUID are one entry in its processor and encoder caches, so the second would
    be served the first's features. The same media under one UUID (the same object, or
    equal items in the same form, compared by content key) and an item asked for from
    the cache under the UUID of an item of its modality that the record sends are one
    item, and taken. So are items of two modalities whose UUIDs vLLM hashes with their
    modality's name (``options``, the part's processor and media-io options: see
    :func:`_rehashes_uuids`), as its chat parser names a video's audio with the video's
    UUID under ``use_audio_in_video``; within each modality, one item still.
    """
    named = {} if named is None else named
    for modality, items, given in view:
        if given is None or items is None:
            continue  # a modality with UUIDs and no data: vLLM keys nothing under them
        for i, uuid in enumerate(given):
            if uuid is None:
                continue
            item = items[i]
            place = f"{part}multi_modal_data[{modality!r}][{i}]"
            under = named.setdefault(uuid, {})
            first = under.get(modality)
            if first is not None:  # one key for both, whatever the options
                first_place, first_item = first
                if first_item is None and item is not None:
                    under[modality] = (place, item)  # compared with the first item it sends
                    continue
                if item is None or _same_media(modality, item, first_item):
                    continue
                raise _one_uuid_over_two(uuid, part, modality, i, first_place)
            for other, (other_place, _) in under.items():
                if not (
                    other_place.startswith(part)  # in this part: keyed with these options
                    and _rehashes_uuids(modality, options)
                    and _rehashes_uuids(other, options)
                ):
                    raise _one_uuid_over_two(uuid, part, modality, i, other_place)
            under[modality] = (place, item)  # two keys: vLLM hashes each with its modality's name
    return named


def _one_uuid_over_two(
    uuid: str, part: str, modality: str, index: int, first_place: str
) -> InvalidPromptError:
    return InvalidPromptError(
        f"$.{part}multi_modal_uuids.{modality}[{index}]",
        f"UUID {uuid!r} also names {first_place}, "
        "which is other media; a UUID is the engine's cache key for one item, so this item "
        "would be served that one's features. Give each item its own UUID",
    )


def _check_uuids_name_their_items(uuids: MediaUUIDs, view: tuple[MediaRow, ...]) -> None:
    """Refuse UUIDs that a record of other media already uses for those items.

    A UUID names one item: ``attrs.evolve(template, multi_modal_data=new)`` would hand the
    template's UUIDs to the new media, and the engine would serve the old media's cached
    features for it. Items are compared by identity first (records share their frozen
    items), then by their keys (equal media in new objects, such as a file loaded again).
    """
    pairs = tuple((m, items) for m, items, given in view if given is not None)
    first = _UUID_PAIRS.get(uuids)
    if first is None:
        _UUID_PAIRS.put(uuids, pairs)
        return
    before = dict(first)
    for modality, items, given in view:
        if given is None:
            continue
        old = before.get(modality)
        for i, uuid in enumerate(given):
            if uuid is None:
                continue
            if items is not None and items[i] is None:
                continue  # an item asked for from the cache: no media goes out under the UUID
            before_item = old[i] if old is not None and i < len(old) else None
            if items is not None and before_item is None:
                raise InvalidPromptError(
                    f"$.multi_modal_uuids.{modality}[{i}]",
                    f"UUID {uuid!r} comes from a record that sent no item for it (cached only), so "
                    "nothing shows this item is the media it names; give the UUIDs you mean",
                )
            same = old is None if items is None else _same_media(modality, items[i], before_item)
            if not same:
                raise InvalidPromptError(
                    f"$.multi_modal_uuids.{modality}[{i}]",
                    f"UUID {uuid!r} comes from a record where it named other media; a UUID is "
                    "the engine's cache key for one item. To swap media use record.replace_media(...), "
                    "which drops the replaced items' UUIDs, or give the UUIDs you mean",
                )


@attrs.frozen(kw_only=True, getstate_setstate=False)
class TextPrompt(_Prompt):
    """A text prompt (vLLM's ``TextPrompt``, vllm-omni's ``OmniTextPrompt``).

    >>> import numpy as np
    >>> image = np.zeros((4, 4, 3), np.uint8)
    >>> p = TextPrompt(prompt="<image> what is this?", multi_modal_data={"image": image})
    >>> len(p.multi_modal_data["image"])
    1
    """

    prompt: str = attrs.field(converter=_prompt)
    negative_prompt: str | None = attrs.field(default=None, converter=_negative_prompt)
    prompt_embeds: Any = attrs.field(
        converter=_optional_prompt_embeds, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    negative_prompt_embeds: Any = attrs.field(
        converter=_negative_prompt_embeds, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    modalities: PVector[str] | None = attrs.field(default=None, converter=_modalities)
    """vllm-omni's task selector for one pipeline (``["image"]``, ``["img2img"]``, ``["text"]``)."""


@attrs.frozen(kw_only=True, getstate_setstate=False)
class TokensPrompt(_Prompt):
    """A tokenized prompt (vLLM's ``TokensPrompt``, vllm-omni's ``OmniTokensPrompt``)."""

    prompt_token_ids: PVector[int] = attrs.field(converter=_prompt_token_ids)
    prompt: str | None = attrs.field(default=None, converter=_optional_prompt)
    token_type_ids: PVector[int] | None = attrs.field(default=None, converter=_token_type_ids)
    prompt_token_offsets: Any = attrs.field(
        converter=_prompt_token_offsets, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    negative_prompt: str | None = attrs.field(default=None, converter=_negative_prompt)
    prompt_embeds: Any = attrs.field(
        converter=_optional_prompt_embeds, default=None, eq=_media_eq, hash=False, repr=_summary
    )
    negative_prompt_embeds: Any = attrs.field(
        converter=_negative_prompt_embeds_list, default=None, eq=_media_eq, hash=False, repr=_summary
    )


@attrs.frozen(kw_only=True, getstate_setstate=False)
class EmbedsPrompt(_Prompt):
    """A prompt given as embeddings (vLLM's ``EmbedsPrompt``, vllm-omni's ``OmniEmbedsPrompt``)."""

    prompt_embeds: Any = attrs.field(converter=_prompt_embeds, eq=_media_eq, hash=False, repr=_summary)
    prompt: str | None = attrs.field(default=None, converter=_optional_prompt)
    prompt_token_ids: PVector[int] | None = attrs.field(default=None, converter=_optional_prompt_token_ids)
    prompt_is_token_ids: PVector[bool] | None = attrs.field(default=None, converter=_prompt_is_token_ids)
    negative_prompt_embeds: Any = attrs.field(
        converter=_negative_prompt_embeds_list, default=None, eq=_media_eq, hash=False, repr=_summary
    )


SinglePrompt: TypeAlias = TextPrompt | TokensPrompt | EmbedsPrompt
SINGLE_KINDS: Final = (TextPrompt, TokensPrompt, EmbedsPrompt)
"""The record kinds of a single prompt, for ``isinstance``: the one place that lists them."""


def _single(path: str, *, optional: bool) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(_: object, __: attrs.Attribute[Any], value: object) -> None:
        if value is None and optional:
            return
        if not isinstance(value, SINGLE_KINDS):
            raise PromptTypeError(
                path, f"must be a TextPrompt, TokensPrompt or EmbedsPrompt, got {type_name(value)}"
            )

    return check


@attrs.frozen(kw_only=True, getstate_setstate=False)
class EncoderDecoderPrompt:
    """vLLM's ``ExplicitEncoderDecoderPrompt``: two single prompts, scoped together.

    ``scope_to_replica`` of a pair scopes both parts, under the one policy either carries.
    A pair may be built from parts scoped apart, but ``to_vllm`` refuses one whose parts
    carry media keys in different scopes: the request goes to one replica.
    """

    encoder_prompt: SinglePrompt = attrs.field(validator=_single("$.encoder_prompt", optional=False))
    decoder_prompt: SinglePrompt | None = attrs.field(
        default=None, validator=_single("$.decoder_prompt", optional=True)
    )

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (_rebuild, (type(self), plain_fields(self)))

    def __getstate__(self) -> dict[str, Any]:
        return plain_fields(self)  # as _Prompt's

    def __copy__(self) -> Self:
        return self  # immutable, like the single prompts (see _Prompt.__copy__)

    def __attrs_pre_init__(self) -> None:
        refuse_second_init(self, "encoder_prompt")

    def __attrs_post_init__(self) -> None:
        # Both parts go through one processor cache (vLLM renders the encoder's first):
        # a UUID in both names one item there.
        decoder = self.decoder_prompt
        if decoder is not None and self.encoder_prompt._view and decoder._view:
            named = _check_one_item_per_uuid(
                self.encoder_prompt._view, part="encoder_prompt.", options=_options(self.encoder_prompt)
            )
            _check_one_item_per_uuid(decoder._view, named, part="decoder_prompt.", options=_options(decoder))


def check_one_scope(pair: EncoderDecoderPrompt) -> None:
    """Refuses to render a pair whose parts carry media keys in different scopes.

    A pair goes to one replica, so its keys are rendered in one scope: ``scope_to_replica``
    of the pair scopes both parts (a part without media keeps its own). A pair built from
    parts scoped apart may still carry a policy for both, and is scoped together later;
    rendered as it is, it would send keys scoped to two replicas or policies.
    """
    encoder, decoder = pair.encoder_prompt, pair.decoder_prompt
    if decoder is None or not encoder._view or not decoder._view or _where(encoder) == _where(decoder):
        return

    def described(scope: Any) -> str:
        return "unscoped" if scope is None else f"scoped to {scope.prefix} under {scope.policy!r}"

    raise InvalidPromptError(
        "$.decoder_prompt",
        f"is {described(decoder.scope)} while the encoder prompt is {described(encoder.scope)}: a pair goes "
        "to one replica, so its media keys are rendered in one scope (scope the pair with "
        "scope_to_replica before rendering it)",
    )


def _where(prompt: SinglePrompt) -> tuple[int, int, Any] | None:
    """Where a part's keys go and how they render: its stage, replica and policy (a
    hasher of another algorithm or model scopes to the same place)."""
    scope = prompt.scope
    return None if scope is None else (scope.stage_id, scope.replica_id, scope.policy)


Prompt: TypeAlias = TextPrompt | TokensPrompt | EmbedsPrompt | EncoderDecoderPrompt


def replace_fields(record: Any, **changes: Any) -> Any:
    """A copy of ``record`` with ``changes``, skipping the checks.

    Only for values that are already valid and frozen (a scope, a record's own fields):
    it is what makes scoping cost a microsecond instead of a full re-validation. Names
    that are not fields of the record are ignored.
    """
    return field_copier(type(record), tuple(changes))(record, *changes.values())


_COPIERS: dict[tuple[type[Any], tuple[str, ...]], Callable[..., Any]] = {}
# Copies that change only these fields keep the original's memo (see _Derived).
_SHARES_MEMO: Final = frozenset({"scope"})


def field_copier(kind: type[Any], names: tuple[str, ...]) -> Callable[..., Any]:
    """``copy(record, *values)``: a ``kind`` record with the fields ``names`` set to ``values``.

    Generated as straight-line code that writes each slot through its descriptor, as
    attrs builds ``__init__``: a loop over ``attrs.fields`` costs three times as much.
    """
    copier = _COPIERS.get((kind, names))
    if copier is not None:
        return copier
    fields = [field.name for field in attrs.fields(kind)]
    namespace: dict[str, Any] = {"_new": object.__new__, "_kind": kind}
    lines = [f"def copy(record, {''.join(f'_v{i}, ' for i in range(len(names)))}):", "    new = _new(_kind)"]
    for i, name in enumerate(fields):
        slot = next((k.__dict__[name] for k in kind.__mro__ if name in k.__dict__), None)
        setter = slot.__set__ if isinstance(slot, types.MemberDescriptorType) else _setter(name)
        namespace[f"_set{i}"] = setter
        value = f"_v{names.index(name)}" if name in names else f"record.{name}"
        lines.append(f"    _set{i}(new, {value})")
    if issubclass(kind, _Derived):
        namespace["_set_memo"] = _Derived.__dict__["_memo"].__set__
        namespace["_set_view"] = _Derived.__dict__["_view"].__set__
        namespace["_view_of"] = _view_of
        # A copy that changes only the scope shares the memo (its entries depend on the
        # other fields or on the scope); any other starts a fresh one. The view goes with
        # the media.
        lines.append(f"    _set_memo(new, {'record._memo' if set(names) <= _SHARES_MEMO else '{}'})")
        media_kept = not set(names) & {"multi_modal_data", "multi_modal_uuids"}
        lines.append(f"    _set_view(new, {'record._view' if media_kept else '_view_of(new)'})")
    lines.append("    return new")
    exec("\n".join(lines), namespace)  # names come from attrs, never from input
    made: Callable[..., Any] = namespace["copy"]
    _COPIERS[(kind, names)] = made
    return made


def _view_of(record: Any) -> tuple[MediaRow, ...]:
    return media_view(plain_map(record.multi_modal_data), plain_map(record.multi_modal_uuids))


def _setter(name: str) -> Callable[[Any, Any], None]:
    def set_field(record: Any, value: Any) -> None:
        object.__setattr__(record, name, value)

    return set_field


def plain_fields(record: Any) -> dict[str, Any]:
    """A record's fields as plain Python values (lists, dicts), media items kept as items.

    This is the pickle format: it holds no pyrsistent objects, whose pickles depend on
    whether pyrsistent's C extension is installed.
    """
    state: dict[str, Any] = {}
    for field in attrs.fields(type(record)):
        value = getattr(record, field.name)
        if field.name == "multi_modal_data":  # in the caller's order, not the PMap's
            value = {m: [pickle_form(thaw(item)) for item in items] for m, items in plain_map(value).items()}
        elif field.name == "multi_modal_uuids":
            value = {m: list(uuids) for m, uuids in plain_map(value).items()}
        elif not isinstance(value, (_Prompt, Scope)):
            value = pickle_form(thaw(value))
        state[field.name] = value
    return state


class _ArrayPickle:
    """Pickles an array as dtype, shape and bytes.

    numpy (2.3) unpickles a big-endian array as a native-endian one at protocols below 5,
    and a strided one at any protocol, which changes its dtype and so its key.
    """

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        array = self.array
        return (_restore_array, (array.dtype, array.shape, array.tobytes()))


def _restore_array(dtype: np.dtype[Any], shape: tuple[int, ...], data: bytes) -> np.ndarray[Any, Any]:
    # Over bytes only the unpickler made: a record's own array, whose key can be cached.
    return frozen_array(data, dtype, shape)


class _ImagePickle:
    """Pickles a PIL image a record keeps as given (not sealed) with what Pillow's own
    pickle drops: an RGBA palette (it keeps RGB) and the core's palette, and the parser's
    tags where ``info`` does not give them (set through ``getexif()``, a TIFF's from its
    file). Without them the unpickled record converted, turned and keyed the image
    otherwise."""

    __slots__ = ("image",)

    def __init__(self, image: Any) -> None:
        self.image = image

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        image = self.image
        image.load()  # Pillow realizes a pending palette then
        return (_restore_image, (image, palette_state(image), pickled_tags(image)))


def _restore_image(image: Any, palette: Any, tags: dict[int, Any] | None) -> Any:
    if palette is not None:  # P, PA, and an RGB GIF frame's, which Pillow's pickle drops
        apply_palette_state(image, palette)
    if tags is not None:
        restore_parser_tags(image, tags)
    return image


class _TensorPickle:
    """Pickles a tensor of a dtype torch's own pickle fails on as its dtype, shape and bytes.

    torch (2.14) has no typed storage for uint16, uint32 and uint64, and pickling such a
    tensor raises ``AttributeError``: a record holding one could not be pickled.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        tensor = self.tensor
        name = str(tensor.dtype).removeprefix("torch.")
        raw = tensor.detach().cpu().contiguous().numpy().tobytes()
        return (_restore_tensor, (name, tuple(tensor.shape), raw, str(tensor.device)))


class _GraphTensorPickle:
    """Pickles and deep-copies a tensor that is no leaf of torch's autograd graph (a row
    of a grad-requiring tensor) as torch pickles it: a leaf with its values and its
    ``requires_grad``. torch's own deepcopy refuses such a tensor, so ``copy.deepcopy``
    of a record holding one (vllm-omni deep-copies a request's prompt) failed."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (_as_leaf, (self.tensor.detach(), self.tensor.requires_grad))


def _as_leaf(tensor: Any, requires_grad: bool) -> Any:
    return tensor.requires_grad_(requires_grad)


# The dtypes _TensorPickle carries; each has a numpy twin of the same name.
_TENSOR_PICKLE_DTYPES: Final = frozenset({"torch.uint16", "torch.uint32", "torch.uint64"})


def _restore_tensor(name: str, shape: tuple[int, ...], raw: bytes, device: str) -> Any:
    import torch

    # A bytearray, so the tensor owns writable memory (torch warns over read-only bytes).
    tensor = torch.from_numpy(np.frombuffer(bytearray(raw), dtype=name).reshape(shape))
    return tensor if device == "cpu" else tensor.to(device)


def pickle_form(value: Any) -> Any:
    """``value`` with its arrays, unsealed images and the tensors torch cannot pickle
    wrapped in their pickle forms (above)."""
    # Object arrays (allowed in options, never in media) hold pointers, not bytes; arrays
    # of a dtype of no bytes (V0, in options) cannot be made over bytes: numpy pickles both.
    if isinstance(value, np.ndarray) and not value.dtype.hasobject and value.dtype.itemsize:
        return _ArrayPickle(value)
    if is_torch_tensor(value) and str(value.dtype) in _TENSOR_PICKLE_DTYPES and _plain_tensor(value):
        return _TensorPickle(value)
    if is_torch_tensor(value) and not value.is_leaf:
        return _GraphTensorPickle(value)
    if is_pil_image(value) and not is_sealed_image(value):
        return _ImagePickle(value)
    if isinstance(value, list):
        return [pickle_form(v) for v in value]
    if isinstance(value, tuple):
        return tuple(pickle_form(v) for v in value)
    if isinstance(value, dict):
        return {k: pickle_form(v) for k, v in value.items()}
    return value


def _plain_tensor(tensor: Any) -> bool:
    # A subclass or another layout is left to its own pickle: bytes would not rebuild it.
    import torch

    return type(tensor) is torch.Tensor and tensor.layout is torch.strided


def _rebuild(cls: type[Any], state: dict[str, Any]) -> Any:
    """Unpickle through the constructor, so every value is checked and frozen again."""
    data = state.get("multi_modal_data")
    if data:
        # Lists of items, not values to split again: a pvector says so.
        state = {**state, "multi_modal_data": {m: pvector(items) for m, items in data.items()}}
    return cls(**state)
