"""Convert omni-requests records to and from vLLM's prompt dicts.

Importable without vLLM: it knows vLLM's dict shapes, not its classes. Convert at the
``process_inputs`` boundary and nowhere earlier, so engine code passes records around;
:class:`RecordInputProcessor` (which needs vLLM, imported on first use) is that boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._convert import VllmPrompt, from_vllm, to_vllm

if TYPE_CHECKING:
    from ._processor import RecordInputProcessor

__all__ = ["RecordInputProcessor", "VllmPrompt", "from_vllm", "to_vllm"]


def __getattr__(name: str) -> Any:
    # The wrapper's module imports vLLM lazily too; load it only when asked for.
    if name == "RecordInputProcessor":
        from ._processor import RecordInputProcessor

        return RecordInputProcessor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
