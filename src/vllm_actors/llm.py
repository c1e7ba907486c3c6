"""The offline API, with vLLM's names: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from vllm_actors.protocol.config import EngineConfig
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.protocol.metrics import SummaryQuery, SummaryReply, TimelineQuery, TimelineReply
from vllm_actors.protocol.sampling import SamplingParams

EXECUTORS = ("group", "inprocess")

_ENGINE_ARGS = set(EngineConfig.__struct_fields__) - {"model"}


def make_engine_config(model: str | None, engine_args: Mapping[str, Any]) -> EngineConfig:
    unknown = sorted(set(engine_args) - _ENGINE_ARGS)
    if unknown:
        raise TypeError(f"unknown engine arguments: {', '.join(unknown)}; known: {', '.join(sorted(_ENGINE_ARGS))}")
    if model is None:
        from vllm_actors.default_model import default_model_path

        model = default_model_path()
    return EngineConfig(model=model, **engine_args)


class LLM:
    """An engine for offline batched generation.

    ``model`` is a Hugging Face directory or a .gguf file; with none, the embedded default model
    (SmolLM2-135M-Instruct, GGUF) is used. Engine arguments take vLLM's names (dtype, max_model_len,
    max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, block_size,
    num_gpu_blocks_override, gpu_memory_utilization, seed, enforce_eager, skip_tokenizer_init,
    tensor_parallel_size, ...).
    """

    def __init__(self, model: str | None = None, *, executor: str = "group", **engine_args: Any) -> None:
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        self.config = make_engine_config(model, engine_args)
        self.executor = executor
        self._group = None
        self._ids = itertools.count()
        if executor == "inprocess":
            from vllm_actors.clients.inprocess import InProcessEngine

            self._engine: Any = InProcessEngine(self.config)
            self._tokenizer = self._engine.tokenizer
            return
        from vllm_actors.clients.sync_client import EngineClient
        from vllm_actors.runtime.supervisor import ProcessGroup

        check = os.environ.get("VLLM_ACTORS_CHECK_INVARIANTS", "") not in ("", "0")
        self._group = ProcessGroup(self.config, check_invariants=check).start()
        try:
            self._tokenizer = None
            if self._group.info.tokenizer is not None:
                from vllm_actors.actors.frontend.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self._group.info.tokenizer)
            self._engine = EngineClient(self._group.info, self._tokenizer)
        except BaseException:
            self._group.shutdown()
            raise

    @property
    def engine(self):  # noqa: ANN201 - the in-process engine or the client of the process group
        if self._engine is None:
            raise RuntimeError("this LLM has been shut down")
        return self._engine

    @property
    def group(self):  # noqa: ANN201 - the ProcessGroup, or None in process
        return self._group

    def get_tokenizer(self):  # noqa: ANN201
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.frontend.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.frontend.max_model_len

    def get_metrics(self) -> SummaryReply:
        """Counters, gauges and latency percentiles from the metrics store."""
        reply = self.engine.query_metrics(SummaryQuery())
        if not isinstance(reply, SummaryReply):
            raise RuntimeError(f"the metrics store answered {reply!r}")
        return reply

    def get_timeline(self, request_id: str) -> TimelineReply:
        reply = self.engine.query_metrics(TimelineQuery(request_id=request_id))
        if not isinstance(reply, TimelineReply):
            raise RuntimeError(f"the metrics store answered {reply!r}")
        return reply

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts"
                )
        engine = self.engine
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        prepared = [
            engine.prepare(str(next(self._ids)), prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        for request in prepared:
            engine.submit(request)
        return self._run([request.request_id for request in prepared], use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True)")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [
            {
                "prompt_token_ids": tokenizer.encode(
                    tokenizer.apply_chat_template(
                        list(conversation),
                        add_generation_prompt=add_generation_prompt,
                        **dict(chat_template_kwargs or {}),
                    ),
                    add_special_tokens=False,
                ),
            }
            for conversation in conversations
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(finished) < len(wanted):
                if not engine.has_unfinished:
                    raise RuntimeError("the engine went idle with requests unfinished")
                outputs = engine.poll(100)
                if not outputs and self._group is not None:
                    self._group.raise_if_dead()
                for output in outputs:
                    if output.finished and output.request_id in wanted:
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

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None and hasattr(engine, "close"):
            engine.close()
        if self._group is not None:
            self._group.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
