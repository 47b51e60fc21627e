"""vllm-omni integration: stage-0 replica scoping, the chat path, and routing policies.

Importable without vllm-omni (and without vLLM): it knows the engine's shapes, not
its classes. Records already carry vllm-omni's prompt fields, so
``omni_requests_vllm.to_vllm``/``from_vllm`` produce and accept its ``Omni*Prompt`` dicts.
"""

from ._chat import DEFAULT_PLACEHOLDERS, ChatTemplate, chat_to_prompt, default_chat_template
from ._install import LoadBalancer, Stage0Balancer, Stage0Scoping, install_stage0_scoping
from ._loaders import DefaultLoader, MediaLoader, MediaLoadError, RemoteMediaError, decode_wav
from ._routing import CacheAffinity, RoundRobin, RouteRequest, SelectReplica
from ._stage0 import Stage0Pool, Stage0Result, scope_stage0

__all__ = [
    "DEFAULT_PLACEHOLDERS",
    "CacheAffinity",
    "ChatTemplate",
    "DefaultLoader",
    "LoadBalancer",
    "MediaLoadError",
    "MediaLoader",
    "RemoteMediaError",
    "RoundRobin",
    "RouteRequest",
    "SelectReplica",
    "Stage0Balancer",
    "Stage0Pool",
    "Stage0Result",
    "Stage0Scoping",
    "chat_to_prompt",
    "decode_wav",
    "default_chat_template",
    "install_stage0_scoping",
    "scope_stage0",
]
