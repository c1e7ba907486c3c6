"""The offline API, with vLLM's names: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.core import EngineDeadError, SyncClient
from vllm_actors.engine_args import make_engine_config
from vllm_actors.lora.check import AdapterCheck
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.metrics import SummaryReply, TimelineReply
from vllm_actors.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer
    from vllm_actors.runtime.supervisor import ProcessGroup

EXECUTORS = ("group", "inprocess")

class LLM:
    """An engine for offline batched generation.

    ``model`` is a Hugging Face directory or a .gguf file; with none, the embedded default model
    (SmolLM2-135M-Instruct, GGUF) is used. Engine arguments take vLLM's names (dtype, max_model_len,
    max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, block_size,
    num_gpu_blocks_override, gpu_memory_utilization, seed, enforce_eager, skip_tokenizer_init,
    tensor_parallel_size, pipeline_parallel_size, kv_parallel_size, data_parallel_size, routing_policy,
    distributed_executor_backend ("mp", or "ray": the replicas placed by Ray), ...).

    The process group's supervisor restarts an actor that dies or hangs; ``generate`` goes on and
    returns complete outputs (after a scheduler restart the unfinished requests are sent again
    with the tokens they have). Only when the group gives up does it raise ``EngineDeadError``
    with the reason, as does every later call.
    """

    def __init__(self, model: str | None = None, *, executor: str = "group", **engine_args: Any) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        self.config = make_engine_config(model, engine_args, offline=True)
        self._check_adapter = AdapterCheck.of(self.config)
        self.executor = executor
        self._group: ProcessGroup | None = None
        self._ids = itertools.count()
        self._client: SyncClient | None = None
        if executor == "inprocess":
            if self.config.data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 needs the process group (executor='group')")
            if self.config.distributed_executor_backend != "mp":
                raise ValueError("distributed_executor_backend 'ray' needs the process group (executor='group')")
            from vllm_actors.clients.inprocess import InProcessEngine

            self._client = InProcessEngine(self.config)
            return
        from vllm_actors.clients.core import load_group_tokenizer
        from vllm_actors.clients.sync_client import EngineClient
        from vllm_actors.runtime.supervisor import ProcessGroup

        self._group = ProcessGroup(self.config, check_invariants=self.config.check_invariants).start()
        try:
            self._client = EngineClient(self._group.info, load_group_tokenizer(self._group.info), group=self._group)
        except BaseException:
            self._group.shutdown()
            raise

    @property
    def engine(self) -> SyncClient:
        """The client this LLM drives: the in-process engine or the client of the process group."""
        if self._client is None:
            raise RuntimeError("this LLM has been shut down")
        return self._client

    @property
    def group(self) -> ProcessGroup | None:
        """The process group, or None in process."""
        return self._group

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def get_metrics(self, replica: int | None = None) -> SummaryReply:
        """Counters, gauges and latency percentiles from the metrics store (``replica``: one
        replica's of a replica set; its ``replicas`` lists them)."""
        return self.engine.get_metrics(replica)

    def get_timeline(self, request_id: str) -> TimelineReply:
        return self.engine.get_timeline(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished

    # ------------------------------------------------------------------ engine commands
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: put the engine to sleep. Level 1 offloads the weights to host memory and
        discards the KV cache, level 2 discards both (reloaded from the checkpoint on waking),
        level 0 only pauses scheduling. ``mode``: what becomes of requests in flight ("abort",
        "wait" for them, "keep" them to recompute). Generation waits until ``wake_up``."""
        self.engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: wake what ``tags`` names ("weights", "kv_cache", "scheduling"; None: all)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: empty the prefix cache; False while requests hold blocks (unless
        ``reset_running_requests`` preempts them first)."""
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        ttft_target_ms: float | Sequence[float | None] | None = None,
        e2e_target_ms: float | Sequence[float | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``priority``: one per prompt, as vLLM (lower runs first; the "priority" scheduling
        policy honours it). ``ttft_target_ms`` / ``e2e_target_ms``: latency targets from arrival,
        one for all or one per prompt (the "edf" and "lrs" policies order by them; with
        ``reject_unmeetable`` a request that cannot meet its target raises ValueError).
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); needs ``enable_lora``."""
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        count = len(prompt_list)
        if priority is not None and len(priority) != count:
            raise ValueError(f"priority has {len(priority)} values for {count} prompts")
        priorities = list(priority) if priority is not None else [0] * count
        ttfts, e2es = _per_prompt("ttft_target_ms", ttft_target_ms, count), _per_prompt("e2e_target_ms",
                                                                                         e2e_target_ms, count)
        loras = self._loras(lora_request, count)
        engine = self.engine
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        prepared = [
            dataclasses.replace(engine.prepare(str(next(self._ids)), prompt, params), priority=rank,
                                ttft_target_ms=ttft, e2e_target_ms=e2e, lora_request=lora)
            for prompt, params, rank, ttft, e2e, lora in zip(prompt_list, params_list, priorities, ttfts, e2es, loras,
                                                             strict=True)
        ]
        return self._run(prepared, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        params_list = self._params_list(sampling_params, len(conversations))
        loras = self._loras(lora_request, len(conversations))
        engine = self.engine
        prepared = [
            dataclasses.replace(
                engine.prepare_chat(str(next(self._ids)), conversation, params,  # type: ignore[arg-type]
                                    add_generation_prompt=add_generation_prompt,
                                    chat_template_kwargs=chat_template_kwargs),
                lora_request=lora)
            for conversation, params, lora in zip(conversations, params_list, loras, strict=True)
        ]
        return self._run(prepared, use_tqdm)

    def _run(self, prepared: list[PreparedRequest], use_tqdm: bool) -> list[RequestOutput]:
        """Submit the prepared requests and wait for all of them; outputs in their order."""
        engine = self.engine
        request_ids = [request.request_id for request in prepared]
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            for request in prepared:
                engine.submit(request)
            while len(finished) < len(wanted):
                if not engine.has_unfinished:
                    raise RuntimeError("the engine went idle with requests unfinished")
                outputs = engine.poll(100)  # a dead actor is restarted; the group's failure ends open requests
                for output in outputs:
                    if output.finished and output.request_id in wanted:
                        if engine.failure is not None:
                            raise EngineDeadError(f"the engine failed: {engine.failure}")
                        if output.error is not None:
                            raise ValueError(f"request {output.request_id} failed: {output.error}")
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            for request_id in wanted - set(finished):
                engine.abort(request_id)
            raise
        finally:
            progress.close()
        return [finished[request_id] for request_id in request_ids]

    def _loras(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
               count: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked against the base model."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * count
        else:
            loras = list(lora_request)
            if len(loras) != count:
                raise ValueError(f"lora_request has {len(loras)} values for {count} prompts")
        for lora in loras:
            if lora is not None:
                self._check_adapter(lora)
        return loras

    @staticmethod
    def _params_list(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params_list = list(sampling_params)
        if len(params_list) != count:
            raise ValueError(f"sampling_params: got {len(params_list)} for {count} prompts")
        return params_list

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
        if self._group is not None:
            self._group.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _per_prompt(name: str, value: float | Sequence[float | None] | None, count: int) -> list[float | None]:
    if value is None or isinstance(value, (int, float)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} values for {count} prompts")
    return values
