"""What vllm-omni 0.30 needs to run its own engine on a CPU, for tests only.

- :mod:`.platform`: a CPU ``OmniPlatform`` (vllm-omni ships none), found through the
  ``vllm_omni.platform_plugins`` entry point.
- :mod:`.pipeline`: a one-stage pipeline (a single ``LLM_AR`` stage answering text),
  registered through vllm-omni's public ``register_pipeline`` and run as a
  ``vllm_omni.general_plugins`` entry point, so every engine-core process has it.
- :mod:`.torchvision_ops`: the operator schemas a CUDA-built torchvision expects from
  a CUDA torch; without them it cannot be imported beside the CPU torch.

``tests/omni_engine/test_support.py`` says plainly which of these stopped working.
"""

PIPELINE = "omni_requests_tiny_ar"
"""The registry key of the one-stage pipeline; a deploy config names it as ``pipeline:``."""

DEVICE_VARIABLE = "OMNI_REQUESTS_CPU_DEVICES"
"""The platform's device-visibility variable, which vllm-omni sets per replica."""

DEVICE_COUNT = 2
"""How many "devices" the platform reports: one per stage-0 replica."""
