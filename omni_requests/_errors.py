"""One exception family: every error we raise names the field path it concerns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Self, TypeVar

__all__ = ["InvalidPromptError", "OmniRequestsError", "PromptTypeError"]


# Raised while an input is read, but not by the input: a request timeout's handler, the
# machine out of memory, the caller's stack too deep for the read (records refuse nesting
# deep enough to cause it). Passed on as they are, never reported as a bad input, nor
# taken for one vLLM tolerates (helper-90: a RecursionError cached an image unturned).
NOT_THE_INPUTS: Final = (TimeoutError, MemoryError, RecursionError)

_T = TypeVar("_T")


class OmniRequestsError(Exception):
    """Base of every error omni-requests raises on bad input.

    ``path`` is where the problem is, written like ``$.multi_modal_uuids.image[1]``,
    so a caller building prompts from nested data can find the offending value.
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(_printable(f"{path}: {message}"))

    def __reduce__(self) -> tuple[type[OmniRequestsError], tuple[str, str]]:
        # Errors cross process boundaries (engines run workers); keep them picklable.
        return (type(self), (self.path, self.message))

    def under(self, root: str) -> Self:
        """The same error for a value found at ``root``: its path re-rooted there.

        ``$.multi_modal_uuids.image[1]`` under ``$.encoder_prompt`` becomes
        ``$.encoder_prompt.multi_modal_uuids.image[1]``; ``$`` itself becomes ``root``.
        Raise it ``from None``: the inner traceback points at the same bad value.

        >>> PromptTypeError("$.prompt", "must be a str").under("$[1]").path
        '$[1].prompt'
        """
        inner = self.path
        path = root + inner[1:] if inner.startswith("$") else f"{root}.{inner}"
        return type(self)(path, self.message)


class InvalidPromptError(OmniRequestsError, ValueError):
    """A value has the right type but is not acceptable (lengths, ranges, unknown fields)."""


class PromptTypeError(OmniRequestsError, TypeError):
    """A value has a type the field does not accept."""


def _printable(text: str) -> str:
    """``text``, escaped where UTF-8 cannot carry it: a path or message may echo a caller's
    key holding a lone surrogate (or numpy's code point beyond U+10FFFF), and an error
    that cannot be printed or logged hides the problem it reports."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return ascii(text)[1:-1]
    return text


def type_name(value: object) -> str:
    """The name used for a value's type in error messages."""
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def confirm_fault(error: Exception, again: Callable[[], object]) -> None:
    """Returns where ``error``, raised reading an input, is the input's own; raises it where not.

    It counts as the input's only when ``again()``, the same read made again, fails with
    an exception of its type: one raised from elsewhere, a request timeout's handler
    raising a type of its own (not ``TimeoutError``), does not come twice. A warning the
    process's warnings filter made an error is never the input's: the filter may say
    otherwise at the next read. So what such a failure decides (an image keyed as vLLM's
    parser keeps it, unturned, and cached so; an item refused as bad input) is never
    taken from an exception that was not the input's (found by a review, helper-88).
    """
    if isinstance(error, (Warning, OmniRequestsError, *NOT_THE_INPUTS)):
        raise error
    try:
        again()
    except Exception as second:  # compared with the first below
        if type(second) is type(error):
            return
        if isinstance(second, (Warning, OmniRequestsError, *NOT_THE_INPUTS)):
            raise
    raise error


class Fault:
    """What :func:`read_or_fault` gives for a read that fails on the input itself."""

    __slots__ = ()


_FAULT: Final = Fault()


def read_or_fault(read: Callable[[], _T]) -> _T | Fault:
    """``read()``, or a :class:`Fault` where it fails on the input itself, as
    :func:`confirm_fault` tells by reading again (it raises what is not the input's)."""
    try:
        return read()
    except Exception as error:  # noqa: BLE001 - the input's, or raised by confirm_fault
        confirm_fault(error, read)
        return _FAULT
