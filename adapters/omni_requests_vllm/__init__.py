"""Convert omni-requests records to and from vLLM's prompt dicts.

Importable without vLLM: it knows vLLM's dict shapes, not its classes. Convert at the
``process_inputs`` boundary and nowhere earlier, so engine code passes records around.
"""

from ._convert import VllmPrompt, from_vllm, to_vllm

__all__ = ["VllmPrompt", "from_vllm", "to_vllm"]
