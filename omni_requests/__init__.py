"""Immutable request records for multimodal LLM inference.

Prompts are frozen records; scoping one to a replica returns a new record; media keys
are computed exactly like vLLM's and rendered with their scope only at the engine
boundary. See https://omni-requests.readthedocs.io (``docs/``) for the guide.
"""

from . import _pydantic  # noqa: F401 - records as pydantic fields; imports no pydantic
from ._errors import InvalidPromptError, OmniRequestsError, PromptTypeError
from ._hashing import HashAlgorithm, MediaHasher
from ._keys import KeyOrigin, KeyPolicy, MediaKey, Scope
from ._media import FrozenDict
from ._records import (
    EmbedsPrompt,
    EncoderDecoderPrompt,
    Prompt,
    SinglePrompt,
    TextPrompt,
    TokensPrompt,
)
from ._scoping import media_keys, rendered_uuids, scope_to_replica

__all__ = [
    "EmbedsPrompt",
    "EncoderDecoderPrompt",
    "FrozenDict",
    "HashAlgorithm",
    "InvalidPromptError",
    "KeyOrigin",
    "KeyPolicy",
    "MediaHasher",
    "MediaKey",
    "OmniRequestsError",
    "Prompt",
    "PromptTypeError",
    "Scope",
    "SinglePrompt",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
    "media_keys",
    "rendered_uuids",
    "scope_to_replica",
]

__version__ = "0.1.0"
