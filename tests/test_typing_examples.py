"""The typing examples in tests/typing, run: the types mypy proves are the run-time truth.

mypy (in ``make test``) proves that the examples type-check and the mistakes do not; this
runs them. What mypy accepts the constructors accept, each example returns the kind
its annotation (and its ``assert_type``) claims, and every mistake mypy rejects is also
refused at run time with our own error, for callers without a type checker.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from omni_requests import OmniRequestsError, TextPrompt, TokensPrompt
from tests.typing import constructors, mistakes, narrowing

_ARGUMENTS: dict[str, Callable[[], Any]] = {
    "images": lambda: [np.zeros((2, 2, 3), np.uint8)],
    "uuids": lambda: {"image": ["cat-1"]},
    "options": lambda: {"size": 8},
    "ids": lambda: range(3),
    "record": lambda: TokensPrompt(prompt_token_ids=[1, 2]),
    "body": lambda: {"prompt": "a cat"},
    "text": lambda: json.dumps({"prompt_token_ids": [1, 2]}),
    "fields": lambda: {"prompt_embeds": _tensor()} if _has_torch() else {"prompt": "a"},
    "embeds": lambda: _tensor(),
}


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _tensor() -> Any:
    torch = pytest.importorskip("torch")
    return torch.zeros(2, 4)


def _examples(module: ModuleType) -> list[Any]:
    return [
        pytest.param(function, id=name)
        for name, function in vars(module).items()
        if inspect.isfunction(function)
        and function.__module__ == module.__name__
        and not name.startswith("_")
    ]


def _kind(function: Callable[..., Any]) -> type | tuple[type, ...]:
    annotation = inspect.signature(function).return_annotation  # a str: the module defers them
    kind = vars(inspect.getmodule(function))[annotation]
    return kind.__args__ if hasattr(kind, "__args__") else kind  # Prompt is a union


@pytest.mark.parametrize("example", _examples(constructors) + _examples(narrowing))
def test_each_example_returns_the_kind_it_claims(example: Callable[..., Any]) -> None:
    names = inspect.signature(example).parameters
    result = example(**{name: _ARGUMENTS[name]() for name in names})
    kind = _kind(example)
    assert isinstance(result, kind), (type(result), kind)


@pytest.mark.parametrize("mistake", mistakes.REJECTED_AT_RUN_TIME, ids=lambda f: f.__name__)
def test_each_mistake_mypy_rejects_is_refused_at_run_time(mistake: Callable[[], None]) -> None:
    with pytest.raises(OmniRequestsError) as caught:
        mistake()
    assert caught.value.path.startswith("$")


def test_every_constructor_mistake_is_listed_for_the_run_time_check() -> None:
    type_only = {
        "encoded_bytes_are_not_an_image",
        "text_does_not_give_tokens",
        "token_ids_do_not_give_text",
        "a_vllm_dict_gives_its_own_kind",
    }
    listed = {f.__name__ for f in mistakes.REJECTED_AT_RUN_TIME}
    assert {param.id for param in _examples(mistakes)} == listed | type_only


def test_the_kind_mistakes_are_mistakes_at_run_time_too() -> None:
    # mypy refuses these returns; at run time the kinds differ from the annotations as well.
    assert type(mistakes.text_does_not_give_tokens()) is TextPrompt
    assert type(mistakes.token_ids_do_not_give_text()) is TokensPrompt
    assert type(mistakes.a_vllm_dict_gives_its_own_kind()) is TextPrompt
