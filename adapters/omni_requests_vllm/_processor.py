"""vLLM's ``InputProcessor``, taking records: the one place a record becomes a vLLM dict.

Engine code passes records around (routing, scoping, retries) and hands one to
:meth:`RecordInputProcessor.process_inputs`, which converts it with :func:`to_vllm` and
lets vLLM do the rest. vLLM is imported only when a method runs, so
``import omni_requests_vllm`` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_requests import Prompt

from ._convert import to_vllm

if TYPE_CHECKING:
    from collections.abc import Mapping

    from vllm.config import VllmConfig
    from vllm.inputs import EngineInput
    from vllm.lora.request import LoRARequest
    from vllm.pooling_params import PoolingParams
    from vllm.renderers import BaseRenderer
    from vllm.sampling_params import SamplingParams
    from vllm.tasks import SupportedTask
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.input_processor import InputProcessor

__all__ = ["RecordInputProcessor"]


class RecordInputProcessor:
    """Wraps a vLLM ``InputProcessor`` so that it takes prompt records.

    ``process_inputs(request_id, record, params, supported_tasks)`` renders
    ``to_vllm(record)`` with the processor's own renderer, exactly as vLLM renders a
    prompt dict, and returns vLLM's ``EngineCoreRequest``. A scoped record's media keys
    arrive as its ``multi_modal_uuids``, so the request's ``mm_features`` carry them.

    Build one around an existing processor, or with :meth:`from_config`::

        processor = RecordInputProcessor.from_config(vllm_config)
        request = processor.process_inputs("req-1", record, SamplingParams(), ("generate",))
    """

    __slots__ = ("_processor",)

    def __init__(self, input_processor: InputProcessor) -> None:
        self._processor = input_processor

    @classmethod
    def from_config(
        cls, vllm_config: VllmConfig, renderer: BaseRenderer | None = None
    ) -> RecordInputProcessor:
        """A new vLLM ``InputProcessor`` for ``vllm_config`` (sharing ``renderer`` if given)."""
        from vllm.v1.engine.input_processor import InputProcessor

        return cls(InputProcessor(vllm_config, renderer=renderer))

    @property
    def input_processor(self) -> InputProcessor:
        """The wrapped vLLM ``InputProcessor``."""
        return self._processor

    def render(self, prompt: Prompt, *, tokenization_kwargs: Mapping[str, Any] | None = None) -> EngineInput:
        """vLLM's engine input for ``prompt``: tokens, processed media, their keys.

        The same steps ``InputProcessor.process_inputs`` takes for a prompt dict: parse
        it for the model, then ``render_cmpl`` with the default completion parameters
        updated by ``tokenization_kwargs``.
        """
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        processor = self._processor
        renderer = processor.renderer
        parsed = parse_model_prompt(processor.model_config, to_vllm(prompt))
        tok_params = renderer.default_cmpl_tok_params.with_kwargs(**(tokenization_kwargs or {}))
        (engine_input,) = renderer.render_cmpl([parsed], tok_params)
        result: EngineInput = engine_input
        return result

    def process_inputs(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | PoolingParams,
        supported_tasks: tuple[SupportedTask, ...],
        *,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> EngineCoreRequest:
        """vLLM's ``EngineCoreRequest`` for the record ``prompt``.

        Arguments are ``InputProcessor.process_inputs``'s; further keywords (such as
        ``data_parallel_rank``) go to it unchanged.
        """
        engine_input = self.render(prompt, tokenization_kwargs=tokenization_kwargs)
        request: EngineCoreRequest = self._processor.process_inputs(
            request_id,
            engine_input,
            params,
            supported_tasks,
            arrival_time=arrival_time,
            lora_request=lora_request,
            trace_headers=trace_headers,
            priority=priority,
            **kwargs,
        )
        return request

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._processor!r})"
