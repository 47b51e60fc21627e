"""A caller's container whose own code raises as an adapter reads it is refused by name.

``from_vllm`` and ``scope_stage0`` read the caller's mappings and sequences (their
``__iter__``, ``__len__``, ``__getitem__``, ``__contains__``, ``get``, ``items``,
``__bool__``). Whatever such a read raises comes back as a ``PromptTypeError`` naming
the field it read (``cannot read it (...)``), before anything is built, with the
caller's object unchanged; a ``BaseException`` (Ctrl-C, a signal-raised timeout) is
never caught and propagates as it was raised. ``scope_stage0`` reads a prompt mapping
that is no plain dict (or holds one) once, as a record, and hands that record's dict on:
the methods only the engine calls (``get``, ``__bool__``) never run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from omni_requests import MediaHasher, PromptTypeError
from omni_requests_omni import Stage0Pool, scope_stage0
from omni_requests_omni._stage0 import carries_media
from omni_requests_vllm import from_vllm


class Boom(Exception):
    """What a caller's container raises from its own code."""


class Timeout(BaseException):
    """Like a timeout a signal handler raises: never caught."""


Raise: Any = Callable[[str], BaseException]


def raising(base: type[Any], name: str, error: Raise, *, only: object = None) -> type[Any]:
    """A subclass of ``base`` whose ``name`` raises ``error(name)`` (with ``only``: for that
    argument alone, otherwise it does what ``base`` does)."""
    inherited = getattr(base, name, None)  # None: dict has no __bool__ (bool() reads its length)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if only is None or (args and args[0] == only):
            raise error(name)
        return inherited(self, *args, **kwargs)

    return type(f"Raising{base.__name__.title()}_{name.strip('_')}", (base,), {name: method})


class Key(str):
    """A str subclass key: from_vllm reads such a prompt through its ``items``."""


IMAGE = np.zeros((4, 4, 3), np.uint8)


def media(prompt: str = "<image>") -> dict[str, Any]:
    return {"prompt": prompt, "multi_modal_data": {"image": IMAGE}}


def stage0(prompts: object, replicas: int = 2) -> object:
    pool = Stage0Pool(replicas=replicas, select=lambda request: replicas - 1)
    return scope_stage0(prompts, pool=pool, hasher=MediaHasher("m"))


def stage0_one_replica(prompts: object) -> object:
    return stage0(prompts, replicas=1)


# (what the caller gives, built with the container's error; the call; the path named;
# the method that raises).
Case = tuple[Callable[[Raise], object], Callable[[object], object], str, str]
CASES: dict[str, Case] = {
    # from_vllm: the prompt mapping itself
    "from_vllm prompt __iter__": (
        lambda e: raising(dict, "__iter__", e)({"prompt": "x"}),
        from_vllm,
        "$",
        "__iter__",
    ),
    "from_vllm prompt __getitem__": (
        lambda e: raising(dict, "__getitem__", e)({"prompt": "x"}),
        from_vllm,
        "$.prompt",
        "__getitem__",
    ),
    "from_vllm prompt __contains__": (
        lambda e: raising(dict, "__contains__", e)({"prompt": "x"}),
        from_vllm,
        "$",
        "__contains__",
    ),
    "from_vllm prompt __contains__ of an unlisted field": (
        lambda e: raising(dict, "__contains__", e, only="multi_modal_data")({"prompt": "x"}),
        from_vllm,
        "$",
        "__contains__",
    ),
    "from_vllm str-subclass keys, items": (
        lambda e: raising(dict, "items", e)({Key("prompt"): "x"}),
        from_vllm,
        "$",
        "items",
    ),
    # from_vllm: an encoder-decoder mapping
    "from_vllm pair __iter__": (
        lambda e: raising(dict, "__iter__", e)({"encoder_prompt": "a", "decoder_prompt": "b"}),
        from_vllm,
        "$",
        "__iter__",
    ),
    "from_vllm pair __getitem__": (
        lambda e: raising(dict, "__getitem__", e)({"encoder_prompt": "a", "decoder_prompt": "b"}),
        from_vllm,
        "$.encoder_prompt",
        "__getitem__",
    ),
    "from_vllm pair get": (
        lambda e: raising(dict, "get", e)({"encoder_prompt": "a", "decoder_prompt": "b"}),
        from_vllm,
        "$.decoder_prompt",
        "get",
    ),
    "from_vllm pair __contains__": (
        lambda e: raising(dict, "__contains__", e)({"encoder_prompt": "a", "decoder_prompt": "b"}),
        from_vllm,
        "$",
        "__contains__",
    ),
    "from_vllm pair's encoder __iter__": (
        lambda e: {"encoder_prompt": raising(dict, "__iter__", e)({"prompt": "a"}), "decoder_prompt": "b"},
        from_vllm,
        "$.encoder_prompt",
        "__iter__",
    ),
    # from_vllm: the media maps, as vLLM reads them (_as_vllm_reads)
    "from_vllm multi_modal_data items": (
        lambda e: {
            "prompt": "x",
            "multi_modal_data": raising(dict, "items", e)({"image": IMAGE}),
            "multi_modal_uuids": {"image": "a"},
        },
        from_vllm,
        "$.multi_modal_data",
        "items",
    ),
    "from_vllm multi_modal_uuids items (a modality of None data)": (
        lambda e: {
            "prompt": "x",
            "multi_modal_data": {"image": None},
            "multi_modal_uuids": raising(dict, "items", e)({"image": "a"}),
        },
        from_vllm,
        "$.multi_modal_uuids",
        "items",
    ),
    # scope_stage0: the batch (_batch)
    "scope_stage0 list batch __iter__": (
        lambda e: raising(list, "__iter__", e)([media()]),
        stage0,
        "$",
        "__iter__",
    ),
    "scope_stage0 list batch __len__": (
        lambda e: raising(list, "__len__", e)([media()]),
        stage0,
        "$",
        "__len__",
    ),
    "scope_stage0 tuple batch __iter__": (
        lambda e: raising(tuple, "__iter__", e)((media(),)),
        stage0,
        "$",
        "__iter__",
    ),
    "scope_stage0 tuple batch __len__": (
        lambda e: raising(tuple, "__len__", e)((media(),)),
        stage0,
        "$",
        "__len__",
    ),
    "scope_stage0 token list in a batch __iter__": (
        lambda e: [raising(list, "__iter__", e)([1, 2]), media()],
        stage0,
        "$[0]",
        "__iter__",
    ),
    "scope_stage0 prompt __contains__, in a batch": (
        lambda e: [{"prompt": "y"}, raising(dict, "__contains__", e)(media())],
        stage0,
        "$[1]",
        "__contains__",
    ),
    "scope_stage0 one replica prompt __contains__": (
        lambda e: raising(dict, "__contains__", e)(media()),
        stage0_one_replica,
        "$",
        "__contains__",
    ),
    # Where a pair is read as a record (from_vllm's read of a mapping that is no plain dict)
    "scope_stage0 one replica pair get": (
        lambda e: raising(dict, "get", e)({"encoder_prompt": media(), "decoder_prompt": "b"}),
        stage0_one_replica,
        "$.decoder_prompt",
        "get",
    ),
    # carries_media, which the installed scoping runs on the engine's copy of a prompt
    "carries_media prompt get": (
        lambda e: raising(dict, "get", e)(media()),
        carries_media,
        "$.multi_modal_data",
        "get",
    ),
    "carries_media multi_modal_data __bool__": (
        lambda e: {"prompt": "x", "multi_modal_data": raising(dict, "__bool__", e)({"image": IMAGE})},
        carries_media,
        "$.multi_modal_data",
        "__bool__",
    ),
    "carries_media multi_modal_data __len__": (
        lambda e: {"prompt": "x", "multi_modal_data": raising(dict, "__len__", e)({"image": IMAGE})},
        carries_media,
        "$.multi_modal_data",
        "__len__",
    ),
    "carries_media pair's encoder get": (
        lambda e: {"encoder_prompt": raising(dict, "get", e)(media()), "decoder_prompt": "b"},
        carries_media,
        "$.encoder_prompt.multi_modal_data",
        "get",
    ),
}


# Methods only the engine would call on a prompt (vLLM reads a prompt by ``get``, a UUID
# row by ``len`` and ``[i]``): scope_stage0 reads a mapping that is no plain dict once,
# as a record, and hands on that record's dict, so none of them runs.
NOT_READ: dict[str, tuple[Callable[[Raise], object], Callable[[object], object]]] = {
    "prompt get": (lambda e: raising(dict, "get", e)(media()), stage0),
    "prompt get, one replica": (lambda e: raising(dict, "get", e)(media()), stage0_one_replica),
    "prompt get, in a batch": (lambda e: [{"prompt": "y"}, raising(dict, "get", e)(media())], stage0),
    "multi_modal_data __bool__": (
        lambda e: {"prompt": "x", "multi_modal_data": raising(dict, "__bool__", e)({"image": IMAGE})},
        stage0,
    ),
    "multi_modal_data __len__": (
        lambda e: {"prompt": "x", "multi_modal_data": raising(dict, "__len__", e)({"image": IMAGE})},
        stage0,
    ),
    "pair's encoder get": (
        lambda e: {"encoder_prompt": raising(dict, "get", e)(media()), "decoder_prompt": "b"},
        stage0,
    ),
}


@pytest.mark.parametrize("batch", [False, True])
def test_scope_stage0_refuses_a_uuid_map_that_cannot_be_read_as_a_record_would(batch: bool) -> None:
    prompt = {**media(), "multi_modal_uuids": raising(dict, "items", Boom)({"image": "a"})}
    before = snapshot(prompt)
    with pytest.raises(PromptTypeError, match=r"entries cannot be read \(Boom: items\)$") as caught:
        stage0_one_replica([media(), prompt] if batch else prompt)
    assert caught.value.path == ("$[1]" if batch else "$") + ".multi_modal_uuids"
    assert snapshot(prompt) == before


def _holds_subclass(value: object) -> bool:
    if isinstance(value, (dict, list, tuple)) and type(value) not in (dict, list, tuple):
        return True
    if isinstance(value, dict):
        return any(map(_holds_subclass, value.values()))
    return isinstance(value, (list, tuple)) and any(map(_holds_subclass, value))


@pytest.mark.parametrize("case", list(NOT_READ), ids=list(NOT_READ))
def test_scope_stage0_hands_on_what_it_read_without_the_engines_reads(case: str) -> None:
    build, call = NOT_READ[case]
    given = build(Boom)
    before = snapshot(given)
    _, sent = call(given)  # type: ignore[misc]
    assert not _holds_subclass(sent)
    assert snapshot(given) == before


def snapshot(value: object) -> object:
    """``value``'s contents, read through the built-in types' own methods (never the
    subclass's, which raise)."""
    if isinstance(value, dict):
        return (type(value), [(key, snapshot(item)) for key, item in dict.items(value)])
    if isinstance(value, list):
        return (type(value), [snapshot(item) for item in list.copy(value)])
    if isinstance(value, tuple):
        return (type(value), [snapshot(tuple.__getitem__(value, i)) for i in range(tuple.__len__(value))])
    if isinstance(value, np.ndarray):
        return (value.shape, value.dtype, value.flags.writeable, value.tobytes())
    return (type(value), value)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_raising_read_is_refused_by_name_and_the_caller_is_untouched(case: str) -> None:
    build, call, path, method = CASES[case]
    given = build(Boom)
    before = snapshot(given)
    with pytest.raises(PromptTypeError) as caught:
        call(given)
    error = caught.value
    assert error.path == path
    assert error.message == f"cannot read it (Boom: {method})"
    assert error.__cause__ is None and error.__suppress_context__  # raised from None
    assert snapshot(given) == before


@pytest.mark.parametrize("kind", [KeyboardInterrupt, Timeout])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_base_exception_from_the_container_propagates_unchanged(
    case: str, kind: type[BaseException]
) -> None:
    build, call, _, method = CASES[case]
    raised: list[BaseException] = []

    def error(name: str) -> BaseException:
        raised.append(kind(name))
        return raised[-1]

    given = build(error)
    before = snapshot(given)
    with pytest.raises(kind) as caught:
        call(given)
    assert type(caught.value) is kind
    assert caught.value is raised[-1]
    assert caught.value.args == (method,)
    assert snapshot(given) == before


def test_a_runtime_error_from_a_media_maps_length_is_no_array_ambiguity() -> None:
    # An array or tensor of several values raises ValueError or RuntimeError from bool():
    # it carries media, and converting it refuses it. A mapping raising them cannot be read.
    data = raising(dict, "__len__", RuntimeError)({"image": IMAGE})
    with pytest.raises(
        PromptTypeError, match=r"^\$\.multi_modal_data: cannot read it \(RuntimeError: __len__\)$"
    ):
        carries_media({"prompt": "x", "multi_modal_data": data})
    with pytest.raises(PromptTypeError, match=r"^\$\.multi_modal_data: "):
        stage0({"prompt": "x", "multi_modal_data": np.zeros((2, 4, 4, 3), np.uint8)})


def test_an_exception_whose_own_str_raises_is_still_named() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise Boom("__str__")

    prompt = raising(dict, "__iter__", lambda name: Unprintable())({"prompt": "x"})
    with pytest.raises(PromptTypeError, match=r"^\$: cannot read it \(Unprintable: <unprintable>\)$"):
        from_vllm(prompt)


def test_a_timeout_outside_the_reads_propagates_unchanged() -> None:
    # pool.select is the caller's code too, run after every read: never caught.
    timeout = Timeout("select")

    def select(request: object) -> int:
        raise timeout

    pool = Stage0Pool(replicas=2, select=select)
    with pytest.raises(Timeout) as caught:
        scope_stage0(media(), pool=pool, hasher=MediaHasher("m"))
    assert caught.value is timeout


def test_plain_containers_still_convert_and_scope() -> None:
    assert from_vllm(
        {"prompt": "x", "multi_modal_data": {"image": None}, "multi_modal_uuids": {"image": "a"}}
    )
    replica, prompts = stage0([{"prompt": "y"}, [1, 2], media()])
    assert replica == 1
    assert prompts[1] == [1, 2]
    assert prompts[2]["multi_modal_uuids"]["image"][0].startswith("stage0:rep1:")
