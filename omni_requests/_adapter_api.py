"""The seam between the core and its adapters: the only private names adapters may use.

Adapters (``omni_requests_vllm``, ``omni_requests_omni``) live outside the core but sit
on its hot path: ``to_vllm`` runs on every request. What they need beyond the public API
is here, and nothing else crosses (``tests/test_adapter_seam.py`` walks the adapters'
source and refuses any other private import or any access to a record's private state).
Everything here is internal: it may change with the adapters, in the same release.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._embedding_fields import EmbeddingFields, is_embedding_modality, merge_embedding_fields
from ._errors import NOT_THE_INPUTS, PromptTypeError, type_name
from ._hashing import image_parses
from ._keys import check_index
from ._media import as_made, is_own_array, is_pil_image, is_torch_tensor, thaw
from ._records import (
    SINGLE_KINDS,
    MediaRow,
    SinglePrompt,
    check_one_scope,
    check_uuid,
    fits_embeds_prompt,
    refuse_engine_scoped,
    values_equal,
)
from ._scoping import key_bases, one_request, unscoped
from ._sealed import seal_of, unsealed

__all__ = [
    "NOT_THE_INPUTS",
    "SINGLE_KINDS",
    "EmbeddingFields",
    "as_made",
    "check_index",
    "check_one_scope",
    "check_uuid",
    "derived",
    "fits_embeds_prompt",
    "image_parses",
    "is_embedding_modality",
    "is_own_array",
    "is_pil_image",
    "is_torch_tensor",
    "key_bases",
    "media_rows",
    "merge_embedding_fields",
    "one_request",
    "refuse_engine_scoped",
    "seal_of",
    "thaw",
    "type_name",
    "unreadable",
    "unscoped",
    "unsealed",
    "values_equal",
]

_T = TypeVar("_T")


def media_rows(prompt: SinglePrompt) -> tuple[MediaRow, ...]:
    """The record's media as ``(modality, items or None, uuids or None)`` rows, in the
    caller's modality order; ``items`` is None for UUIDs whose modality sends no data.

    Tuples the record holds and shares with its scoped copies: read them, never keep a
    changed copy as the record's.
    """
    return prompt._view


def derived(prompt: SinglePrompt, key: str, build: Callable[..., _T], *args: Any) -> _T:
    """``build(prompt, *args)``, computed once per template and kept with it.

    The memo is shared by a record and its scoped copies (``scope_to_replica`` changes
    only the scope), so ``build`` must depend only on fields other than the scope.
    ``key`` names the value: prefix it with the adapter's module name. The memo is
    bounded; a value may be computed again.
    """
    memo = prompt._memo
    value: _T | None = memo.get(key)
    if value is None:
        value = memo[key] = build(prompt, *args)
    return value


def unreadable(path: str, error: Exception) -> PromptTypeError:
    """The error for a caller's container at ``path`` whose own code (``__iter__``,
    ``__len__``, ``__getitem__``, ``__contains__``, ``get``, ``items``, ``__bool__``) raised
    ``error`` as an adapter read it."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - an exception whose own __str__ raises
        text = "<unprintable>"
    return PromptTypeError(path, f"cannot read it ({type(error).__name__}: {text})")
