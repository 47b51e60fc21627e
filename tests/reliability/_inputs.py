"""Generated inputs for the reliability tests: garbage, near-valid prompt dicts, snapshots."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import numpy as np
from hypothesis import strategies as st
from PIL import Image

HAS_TORCH = importlib.util.find_spec("torch") is not None

# Every key vLLM's and vllm-omni's prompt dicts know, plus the encoder-decoder ones.
FIELDS = (
    "prompt",
    "prompt_token_ids",
    "token_type_ids",
    "prompt_token_offsets",
    "prompt_embeds",
    "prompt_is_token_ids",
    "multi_modal_data",
    "multi_modal_uuids",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "cache_salt",
    "negative_prompt",
    "negative_prompt_embeds",
    "additional_information",
    "model_intermediate_buffer",
    "modalities",
)
MODALITIES = ("image", "video", "audio", "", "image_embeds", "model_id")
DTYPES = (
    "uint8",
    "int8",
    "int16",
    "int64",
    "float16",
    "float32",
    "float64",
    "bool",
    "complex64",
    "object",
    "<U3",
    "V2",
)


class Opaque:
    """A value of a type nobody registered anything for (equal to its pickled copy)."""

    def __repr__(self) -> str:
        return "Opaque()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)

    def __hash__(self) -> int:
        return 0


@st.composite
def small_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
    size = math.prod(shape)
    if dtype.kind == "O":
        array = np.empty(shape, dtype)
        array.reshape(-1)[:] = [draw(st.integers()) for _ in range(size)] if size else []
    else:
        array = np.frombuffer(
            draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize)), dtype
        )
        array = array.reshape(shape).copy()
    if draw(st.booleans()) and array.ndim:
        array = array[::-1]  # a non-contiguous view
    if draw(st.booleans()):
        array.flags.writeable = False
    return array


@st.composite
def small_images(draw: st.DrawFn) -> Image.Image:
    # Not "P": Pillow drops or changes palettes when pickling (see test_processes.py).
    mode = draw(st.sampled_from(["RGB", "L", "RGBA", "1", "I;16", "F", "LA"]))
    size = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    return Image.new(mode, size)


@st.composite
def small_tensors(draw: st.DrawFn) -> Any:
    import torch

    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    return torch.zeros(shape, dtype=dtype)


def leaves() -> st.SearchStrategy[Any]:
    options: list[st.SearchStrategy[Any]] = [
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=12),
        st.sampled_from(["stage0:rep1:x", "stage3:rep0:", "image", "", "<image>"]),
        st.binary(max_size=8),
        small_arrays(),
        st.builds(np.float32, st.floats(width=32)),
        st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
        small_images(),
        st.builds(Opaque),
        st.builds(bytearray, st.binary(max_size=4)),
        st.builds(memoryview, st.binary(max_size=4)),
        st.frozensets(st.integers(), max_size=2),
        st.just(Ellipsis),
        st.just(print),
    ]
    if HAS_TORCH:
        options.append(small_tensors())
    return st.one_of(options)


def keys() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(FIELDS + MODALITIES), st.text(max_size=6), st.integers(), st.none())


def garbage(max_leaves: int = 10) -> st.SearchStrategy[Any]:
    """Any value, nested: what a careless or hostile client could send."""
    return st.recursive(
        leaves(),
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.tuples(children),
            st.tuples(children, children),
            st.dictionaries(keys(), children, max_size=4),
            st.dictionaries(st.sampled_from(MODALITIES), children, max_size=3),
        ),
        max_leaves=max_leaves,
    )


@st.composite
def plausible_media(draw: st.DrawFn) -> Any:
    """A modality's value that is often valid: an item, a list of items, an (item, rate) pair."""
    item = draw(st.one_of(small_arrays(), small_images(), st.none(), garbage(3)))
    shape = draw(st.sampled_from(["item", "list", "pair", "frames"]))
    if shape == "list":
        return [item, *draw(st.lists(st.one_of(small_arrays(), st.none()), max_size=2))]
    if shape == "pair":
        return (item, draw(st.one_of(st.integers(0, 48_000), garbage(2))))
    if shape == "frames":
        return [np.zeros((2, 2, 3), np.uint8), item]
    return item


def plausible_uuids(draw: st.DrawFn, modalities: list[str]) -> dict[str, Any]:
    uuid = st.one_of(st.none(), st.text(max_size=6), st.sampled_from(["a", "stage0:rep0:a"]), garbage(2))
    return {m: draw(st.one_of(uuid, st.lists(uuid, max_size=3))) for m in modalities}


@st.composite
def near_valid_dicts(draw: st.DrawFn) -> dict[Any, Any]:
    """A prompt dict close to a valid one, with some fields wrong in some way."""
    main = draw(st.sampled_from(["prompt", "prompt_token_ids", "prompt_embeds", "prompt+ids"]))
    out: dict[Any, Any] = {}
    if main in ("prompt", "prompt+ids"):
        out["prompt"] = draw(st.one_of(st.text(max_size=8), garbage(2)))
    if main in ("prompt_token_ids", "prompt+ids"):
        out["prompt_token_ids"] = draw(st.one_of(st.lists(st.integers(0, 100), max_size=4), garbage(3)))
    if main == "prompt_embeds":
        out["prompt_embeds"] = draw(st.one_of(small_tensors(), garbage(2)) if HAS_TORCH else garbage(2))
    modalities = draw(st.lists(st.sampled_from(MODALITIES[:3]), max_size=3, unique=True))
    if modalities or draw(st.booleans()):
        out["multi_modal_data"] = {m: draw(plausible_media()) for m in modalities}
    if draw(st.booleans()):
        out["multi_modal_uuids"] = plausible_uuids(draw, modalities or ["image"])
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        out[field] = draw(garbage(4))
    if draw(st.booleans()):
        out[draw(keys())] = draw(garbage(2))
    return out


def prompts() -> st.SearchStrategy[Any]:
    """Anything from_vllm may be handed."""
    single = st.one_of(
        near_valid_dicts(), garbage(), st.lists(st.integers(), max_size=4), st.text(max_size=6)
    )
    pair = st.fixed_dictionaries(
        {"encoder_prompt": single}, optional={"decoder_prompt": single, "extra": garbage(1)}
    )
    return st.one_of(near_valid_dicts(), single, pair)


def snapshot(value: Any, seen: dict[int, int] | None = None) -> Any:
    """A comparable picture of a value, nested objects' identities and contents included."""
    seen = {} if seen is None else seen
    if id(value) in seen:
        return ("seen", seen[id(value)])
    seen[id(value)] = len(seen)
    if isinstance(value, dict):
        return ("dict", id(value), [(snapshot(k, seen), snapshot(v, seen)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, id(value), [snapshot(v, seen) for v in value])
    if isinstance(value, np.ndarray):
        content = repr(value.tolist()) if value.dtype.hasobject else value.tobytes()
        return ("nd", id(value), value.dtype.str, value.shape, value.strides, value.flags.writeable, content)
    if isinstance(value, Image.Image):
        return ("image", id(value), value.mode, value.size, value.tobytes(), dict(value.info), value.readonly)
    if isinstance(value, bytearray):
        return ("bytearray", id(value), bytes(value))
    if HAS_TORCH:
        import torch

        if isinstance(value, torch.Tensor):
            return ("tensor", id(value), str(value.dtype), tuple(value.shape), repr(value.tolist()))
    return ("value", type(value).__name__, repr(value))
