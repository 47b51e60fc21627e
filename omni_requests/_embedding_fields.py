"""One item of a model's embedding fields, in vLLM's dict form.

vLLM (with ``--enable-mm-embeds``) takes some models' embeddings only as one dict for a
whole modality: Qwen2-VL's ``{"image_embeds": T, "image_grid_thw": G}``, ``T`` holding
every image's rows one after another and ``G`` one row per image. Its parser splits that
dict into items by the model's field config and keys item ``i`` by the dict its
``DictEmbeddingItems.get(i)`` returns (flat fields sliced, batched fields indexed). A
record holds one :class:`EmbeddingFields` per item, that dict exactly, so its counts,
UUIDs and content keys are vLLM's; ``to_vllm`` merges a modality's items back into the
one dict vLLM takes (:func:`merge_embedding_fields`).

The core never imports torch: the fields are tensors, so torch is imported already
whenever one exists.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any, Final

from ._errors import InvalidPromptError, PromptTypeError, type_name
from ._frozen import refuse_second_init

__all__ = ["EmbeddingFields", "merge_embedding_fields"]

_FLAT: Final = re.compile(r"flat:(-?\d+)")


def _layout_rule(path: str, rule: object) -> str:
    if rule == "flat":
        return "flat:0"
    if isinstance(rule, str) and (rule in ("batched", "shared") or _FLAT.fullmatch(rule)):
        return str.__str__(rule)
    raise InvalidPromptError(
        path,
        f"must be 'batched' (stacked), 'shared' (one value for every item) or 'flat:<dim>' "
        f"(concatenated along dim), got {rule!r}",
    )


class EmbeddingFields(Mapping[str, Any]):
    """One item of a modality given as vLLM's dict of embedding fields.

    ``fields`` is the item's dict of tensors exactly as vLLM's parser gives it for the item
    (``DictEmbeddingItems.get(i)``), in its order: the item's key is vLLM's key of that dict.
    ``layout`` says, per field, how vLLM merges the items of a modality back into one dict:
    ``"batched"`` (stacked along a new first dim), ``"flat:<dim>"`` (concatenated along
    ``dim``; ``"flat"`` is ``"flat:0"``) or ``"shared"`` (one value for all items). The
    adapter's chat path reads both from vLLM's own parser and the model's field config.

    It is a read-only mapping of the fields; equal when the fields (by bytes, in order)
    and the layout are. Unlike other tensors in a record, the fields are copied when the
    item is built and handed out as copies: a grid written in place would make vLLM split
    the merged dict into other items than the record keys.

    >>> import torch
    >>> item = EmbeddingFields(
    ...     {"image_embeds": torch.zeros(4, 8), "image_grid_thw": torch.tensor([1, 4, 4])},
    ...     {"image_embeds": "flat", "image_grid_thw": "batched"},
    ... )
    >>> item.layout["image_embeds"], list(item)
    ('flat:0', ['image_embeds', 'image_grid_thw'])
    """

    __slots__ = ("_fields", "_layout")

    _fields: dict[str, Any]
    _layout: dict[str, str]

    def __init__(self, fields: Mapping[str, Any], layout: Mapping[str, str]) -> None:
        from ._media import check_hashable_tensor, check_text, is_torch_tensor, read_entries

        refuse_second_init(self, "_fields")
        path = "$.fields"
        if not isinstance(fields, Mapping):
            raise PromptTypeError(path, f"must be a mapping of field name to tensor, got {type_name(fields)}")
        if not isinstance(layout, Mapping):
            raise PromptTypeError(
                "$.layout", f"must be a mapping of field name to rule, got {type_name(layout)}"
            )
        # Each read once: what their own code raises is named (a FrozenDict, dict: as they are).
        given_fields, given_layout = read_entries(fields, path), read_entries(layout, "$.layout")
        if not given_fields:
            raise InvalidPromptError(path, "must hold at least one field")
        frozen: dict[str, Any] = {}
        for name, tensor in given_fields:
            if not isinstance(name, str):
                raise PromptTypeError(path, f"field names must be str, got {type_name(name)}")
            name = check_text(path, str.__str__(name))
            where = f"{path}.{name}"
            if not is_torch_tensor(tensor):
                raise PromptTypeError(where, f"must be a torch.Tensor, got {type_name(tensor)}")
            # Its own copy: a field (the grid above all) decides how vLLM splits the merged
            # dict, so a write by whoever holds the given tensor must not reach the item.
            check_hashable_tensor(tensor, where)
            frozen[name] = tensor.detach().clone()
        rules: dict[str, str] = {}
        for name, rule in given_layout:
            if not isinstance(name, str) or name not in frozen:
                raise InvalidPromptError(f"$.layout.{name}", f"names no field; the fields are {list(frozen)}")
            rules[str.__str__(name)] = _layout_rule(f"$.layout.{name}", rule)
        for name, tensor in frozen.items():
            if name not in rules:
                raise InvalidPromptError(
                    f"$.layout.{name}",
                    "is missing: each field needs a merge rule ('batched', 'flat', 'shared')",
                )
            if rules[name].startswith("flat:"):
                dim = int(rules[name][5:])
                if not -tensor.ndim <= dim < tensor.ndim:
                    raise InvalidPromptError(
                        f"$.fields.{name}",
                        f"is flat along dim {dim}, but the tensor has shape {tuple(tensor.shape)}",
                    )
        object.__setattr__(self, "_fields", frozen)
        object.__setattr__(self, "_layout", {name: rules[name] for name in frozen})

    @property
    def layout(self) -> Mapping[str, str]:
        """Each field's merge rule, in the fields' order (a copy)."""
        return dict(self._layout)

    def __getitem__(self, name: str) -> Any:
        return self._fields[name].clone()  # a copy: the item's own tensors never leave it

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingFields):
            return NotImplemented
        from ._records import values_equal

        return list(self._layout.items()) == list(other._layout.items()) and all(
            values_equal(self._fields[k], other._fields[k]) for k in self._fields
        )

    def __hash__(self) -> int:  # by the layout: tensors have no content hash (equal items share it)
        return hash(tuple(self._layout.items()))

    def __repr__(self) -> str:
        from ._records import _summary

        fields = ", ".join(f"{k!r}: {_summary(v)}" for k, v in self._fields.items())
        return f"EmbeddingFields({{{fields}}}, layout={self._layout!r})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self) -> tuple[type[EmbeddingFields], tuple[dict[str, Any], dict[str, str]]]:
        # Copies: whoever calls it gets tensors a write to which cannot reach the item.
        return (type(self), ({name: t.clone() for name, t in self._fields.items()}, dict(self._layout)))

    def __getstate__(self) -> tuple[dict[str, Any], dict[str, str]]:
        return self.__reduce__()[1]  # copies, as __reduce__'s (object's would be the live tensors)


def check_embedding_items(path: str, modality: str, items: list[object]) -> None:
    """Refuse a modality that mixes :class:`EmbeddingFields` with other items, or whose items
    vLLM could not merge into one dict and split back into the same items."""
    if not any(isinstance(item, EmbeddingFields) for item in items):
        return
    first: EmbeddingFields | None = None
    for i, item in enumerate(items):
        where = f"{path}[{i}]"
        if isinstance(item, EmbeddingFields) and f"{modality}_embeds" not in item._fields:
            raise InvalidPromptError(
                where,
                f"holds the fields {list(item._fields)}, not {modality}_embeds: vLLM's parser made "
                "it for another modality",
            )
        if not isinstance(item, EmbeddingFields):
            raise PromptTypeError(
                where,
                f"is {type_name(item)} in a modality of EmbeddingFields: vLLM takes the modality as "
                "one dict of embedding fields, so every item must be EmbeddingFields (a cached-only "
                "None item included: the dict form has none)",
            )
        if first is None:
            first = item
            continue
        if list(item._layout.items()) != list(first._layout.items()):
            raise InvalidPromptError(
                where,
                f"has the layout {item._layout!r}, item 0 has {first._layout!r}; vLLM merges a "
                "modality's items into one dict, so they need the same fields and rules",
            )
        for name, rule in first._layout.items():
            a, b = first._fields[name], item._fields[name]
            if a.dtype != b.dtype:
                raise InvalidPromptError(f"{where}.{name}", f"has dtype {b.dtype}, item 0 has {a.dtype}")
            if rule == "batched" and a.shape != b.shape:
                raise InvalidPromptError(
                    f"{where}.{name}",
                    f"has shape {tuple(b.shape)}, item 0 has {tuple(a.shape)}; a batched field stacks",
                )
            if rule.startswith("flat:"):
                dim = int(rule[5:]) % a.ndim
                if (
                    a.ndim != b.ndim
                    or a.shape[:dim] != b.shape[:dim]
                    or a.shape[dim + 1 :] != b.shape[dim + 1 :]
                ):
                    raise InvalidPromptError(
                        f"{where}.{name}",
                        f"has shape {tuple(b.shape)}, item 0 has {tuple(a.shape)}; a flat field "
                        f"concatenates along dim {dim} only",
                    )
            if rule == "shared" and not _equal(a, b):
                raise InvalidPromptError(
                    f"{where}.{name}", "differs from item 0's; a shared field has one value for all items"
                )


def _equal(a: object, b: object) -> bool:
    from ._records import values_equal

    return values_equal(a, b)


def is_embedding_modality(items: object) -> bool:
    """True when a modality's items are :class:`EmbeddingFields` (checked: all or none are)."""
    return bool(items) and isinstance(items[0], EmbeddingFields)  # type: ignore[index]


def merge_embedding_fields(items: list[EmbeddingFields] | tuple[EmbeddingFields, ...]) -> dict[str, Any]:
    """The one dict vLLM takes for a modality whose items are ``items``: a new dict of new
    tensors each call, so no holder of it can write into the items."""
    torch = sys.modules["torch"]  # the items hold tensors: torch is imported
    first = items[0]
    merged: dict[str, Any] = {}
    for name, rule in first._layout.items():
        values = [item._fields[name] for item in items]
        if rule == "batched":
            merged[name] = torch.stack(values)
        elif rule == "shared" or len(values) == 1:
            merged[name] = values[0].clone()  # never the item's own tensor
        else:
            merged[name] = torch.cat(values, dim=int(rule[5:]))
    return merged
