"""Registers omni-requests' strategies for ``st.from_type``, from Hypothesis' entry point.

Hypothesis calls :func:`register` while it is itself being imported (the ``hypothesis``
entry-point group in ``pyproject.toml``). That import is often started by
:mod:`omni_requests.strategies`, which imports Hypothesis at its top: had the entry point
named a function of that module, Hypothesis would load a half-initialised module and fail
with a circular-import ``AttributeError``. So this module imports nothing of Hypothesis
at its top, and :func:`register` reaches :mod:`omni_requests.strategies` only when a
strategy is first resolved, as Hypothesis' documentation advises for third-party hooks.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["register"]


def _resolved(name: str) -> Callable[[type], Any]:
    """A ``register_type_strategy`` resolver that builds ``strategies.<name>()`` on first use."""

    def resolve(_: type) -> Any:
        from . import strategies

        return getattr(strategies, name)()

    return resolve


def register() -> None:
    """Make ``st.from_type`` give our records and hashers.

    Cheap by design: no Pillow, torch or strategies import. EmbedsPrompt is registered
    only where torch is installed (its strategy makes tensors).
    """
    from hypothesis import strategies as st

    from ._hashing import MediaHasher
    from ._records import EmbedsPrompt, TextPrompt, TokensPrompt

    st.register_type_strategy(TextPrompt, _resolved("text_prompts"))
    st.register_type_strategy(TokensPrompt, _resolved("tokens_prompts"))
    if importlib.util.find_spec("torch") is not None:
        st.register_type_strategy(EmbedsPrompt, _resolved("embeds_prompts"))
    st.register_type_strategy(MediaHasher, _resolved("hashers"))
