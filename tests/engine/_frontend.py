"""Stage-0 replicas the way vllm-omni runs them, with in-process vLLM engines.

One :class:`Frontend` is one frontend process: one vLLM renderer, so one processor
("sender") cache, in front of several engines, each with its own engine core, receiver
cache and encoder cache. The frontend picks a replica, scopes the prompt's media keys
to it, renders the prompt with its renderer and hands the engine input to that replica's
``LLMEngine.add_request``, then steps the engine until the request finishes.

Two ways in: :meth:`Frontend.send` takes a record (scoped with ``scope_to_replica``,
rendered by :class:`RecordInputProcessor`), :meth:`Frontend.send_dict_old_way` a plain
dict scoped the way vllm-omni did before its fix: the scoped keys are written back
into the caller's dict.

Nothing here imports vLLM at import time (the main environment collects this folder).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs

from omni_requests import KeyPolicy, MediaHasher, Prompt, SinglePrompt, media_keys, scope_to_replica
from omni_requests_omni import RouteRequest, SelectReplica
from omni_requests_vllm import RecordInputProcessor

__all__ = ["Frontend", "Output", "cache_keys", "output_of"]


@attrs.frozen
class Output:
    """What a test compares: the greedy tokens and each one's logprob."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str

    def __str__(self) -> str:
        return f"{list(self.token_ids)} {[round(lp, 4) for lp in self.logprobs]}"


def output_of(request_output: Any) -> Output:
    """The first completion of a vLLM ``RequestOutput`` as an :class:`Output`."""
    completion = request_output.outputs[0]
    logprobs = tuple(
        float(step[token].logprob)
        for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
    )
    return Output(tuple(completion.token_ids), logprobs, completion.text)


def cache_keys(engine: Any) -> dict[str, set[str]]:
    """The keys in an ``LLMEngine``'s three media caches, read as vLLM's own tests read them.

    ``sender``: the frontend's processor cache (``renderer._mm_processor_cache._cache``);
    ``receiver``: the engine core's (``engine_core.mm_receiver_cache._cache``);
    ``encoder``: the scheduler's encoder cache (``encoder_cache_manager.cached``).
    """
    core = engine.engine_core.engine_core  # in-process: InprocClient -> EngineCore
    return {
        "sender": set(engine.renderer._mm_processor_cache._cache),
        "receiver": set(core.mm_receiver_cache._cache),
        "encoder": set(core.scheduler.encoder_cache_manager.cached),
    }


class Frontend:
    """One frontend (one renderer, one sender cache) in front of ``engines`` (``LLM`` objects)."""

    def __init__(
        self, engines: Sequence[Any], *, hasher: MediaHasher, policy: KeyPolicy | None = None
    ) -> None:
        self.llms = list(engines)
        self.hasher = hasher
        self.policy = policy
        # The frontend's own InputProcessor: its renderer holds the one sender cache.
        self.processor = RecordInputProcessor.from_config(self.llms[0].llm_engine.vllm_config)
        self.sent: list[tuple[int, Prompt]] = []  # (replica, scoped record) for records sent
        self._ids = itertools.count()

    @property
    def sender_keys(self) -> set[str]:
        return set(self.processor.input_processor.renderer._mm_processor_cache._cache)

    def replica_keys(self, replica: int) -> dict[str, set[str]]:
        keys = cache_keys(self.llms[replica].llm_engine)
        keys["sender"] = self.sender_keys
        return keys

    def route(self, record: SinglePrompt, policy: SelectReplica) -> int:
        """The replica ``policy`` picks for ``record``, seeing its unscoped key bases."""

        def bases() -> list[str]:
            return [k.base for row in media_keys(record, self.hasher).values() for k in row if k is not None]

        choice = policy(RouteRequest(None, range(len(self.llms)), bases))
        assert choice is not None
        return choice

    def send(self, record: SinglePrompt, replica: int, params: Any) -> Output:
        """Scope ``record`` to ``replica``, render it here, run it there."""
        scoped = scope_to_replica(record, replica, hasher=self.hasher, policy=self.policy)
        engine_input = self.processor.render(scoped)
        self.sent.append((replica, scoped))
        return self._run(replica, engine_input, params)

    def send_dict_old_way(self, prompt: dict[str, Any], replica: int, params: Any) -> Output:
        """vllm-omni's stage-0 scoping before its fix, on a plain dict, then the same path.

        Each item's base is its UUID if the dict has one, else its content hash; the
        scoped keys are written back into ``prompt`` itself (the bug).
        """
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        given = prompt.get("multi_modal_uuids") or {}
        scoped: dict[str, list[str]] = {}
        for modality, items in prompt["multi_modal_data"].items():
            items = items if isinstance(items, list) else [items]
            uuids = given.get(modality)
            uuids = [uuids] if isinstance(uuids, str) else (uuids or [None] * len(items))
            scoped[modality] = [
                f"stage0:rep{replica}:{uuid if uuid is not None else self.hasher.key(modality, item)}"
                for item, uuid in zip(items, uuids, strict=True)
            ]
        prompt["multi_modal_uuids"] = scoped  # written back into the caller's dict
        renderer = self.processor.input_processor.renderer
        parsed = parse_model_prompt(renderer.model_config, dict(prompt))
        (engine_input,) = renderer.render_cmpl([parsed], renderer.default_cmpl_tok_params)
        return self._run(replica, engine_input, params)

    def _run(self, replica: int, engine_input: Any, params: Any) -> Output:
        engine = self.llms[replica].llm_engine
        request_id = f"req-{next(self._ids)}"
        engine.add_request(request_id, engine_input, params)
        while True:
            for out in engine.step():
                if out.request_id == request_id and out.finished:
                    return output_of(out)
