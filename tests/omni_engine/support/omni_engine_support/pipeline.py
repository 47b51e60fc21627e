"""A one-stage vllm-omni pipeline: stage 0 is an ``LLM_AR`` stage that answers text.

Stage 0 with several replicas is where vllm-omni scopes media keys; one stage is all
the tests need. It is registered under :data:`omni_engine_support.PIPELINE` through
vllm-omni's public ``register_pipeline``; a deploy config selects it with
``pipeline: omni_requests_tiny_ar``. :func:`register` is also the
``vllm_omni.general_plugins`` entry point, so the engine-core processes, which resolve
the pipeline again, have it too.
"""

from __future__ import annotations

from . import PIPELINE

_registered = False


def register() -> None:
    """Register the pipeline with vllm-omni (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm_omni.config.pipeline_registry import register_pipeline
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    register_pipeline(
        PipelineConfig(
            model_type=PIPELINE,
            model_arch="Qwen2VLForConditionalGeneration",
            stages=(
                StagePipelineConfig(
                    stage_id=0,
                    model_stage="thinker",
                    execution_type=StageExecutionType.LLM_AR,
                    input_sources=(),
                    final_output=True,
                    final_output_type="text",
                    owns_tokenizer=True,
                    requires_multimodal_data=True,
                    sampling_constraints={"detokenize": True},
                ),
            ),
        )
    )
    _registered = True
