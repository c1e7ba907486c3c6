"""The offline API, with vLLM's names: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from vllm_actors.config import EngineConfig
from vllm_actors.outputs import RequestOutput
from vllm_actors.protocol.sampling import SamplingParams

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

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        from vllm_actors.engine import InProcessEngine

        self.config = make_engine_config(model, engine_args)
        self._engine: InProcessEngine | None = InProcessEngine(self.config)
        self._ids = itertools.count()

    @property
    def engine(self):  # noqa: ANN201 - the engine type stays out of the public import path
        if self._engine is None:
            raise RuntimeError("this LLM has been shut down")
        return self._engine

    def get_tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

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
        tokenizer = self.engine.tokenizer
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
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        if output.error is not None:
                            raise ValueError(f"request {output.request_id} failed: {output.error}")
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            for request_id in wanted - set(finished):
                engine.abort(request_id)
            engine.run_until_idle()
            raise
        finally:
            progress.close()
        engine.run_until_idle()  # lets the scheduler hand the last finished blocks back
        return [finished[request_id] for request_id in request_ids]

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
