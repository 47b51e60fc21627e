"""What every immutable class of the library refuses: being built a second time."""

from __future__ import annotations


def refuse_second_init(instance: object, slot: str) -> None:
    """Raise ``TypeError`` where ``instance`` is built already (its ``slot`` is set).

    ``__init__`` called again by hand would rewrite the object in place, under the keys,
    hashes and caches computed from its old values.
    """
    if hasattr(instance, slot):
        raise TypeError(f"{type(instance).__name__} is immutable; build a new one")
