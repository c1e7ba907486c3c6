"""The transformers baseline: the same requests through transformers' own continuous batching.

The model is built from the same ``config.json`` as ours (random init, or the checkpoint's weights
with ``--model``), in bf16 on CUDA, with transformers' paged SDPA attention. Requests go through
``continuous_batching_context_manager`` + ``add_request`` with each request's own
``max_new_tokens`` and no EOS (``eos_token_id=-1``, like ``ignore_eos``), sampling at the same
temperature with no top-k / top-p. The timed span runs from the first ``add_request`` to the last
finished result, after the manager's own warm-up (CUDA graph capture) and a few warm-up requests.

Written against transformers 5.17, defensively: keyword arguments a version does not take are
left out, and where ``add_request`` takes no per-request ``max_new_tokens`` the requests run in
groups of equal length through ``generate_batch``.
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

NO_EOS = -1  # matches no token: every request runs to its max_new_tokens


@dataclass(frozen=True)
class PeerResult:
    name: str
    num_requests: int
    output_tokens: int
    expected_output_tokens: int
    seconds: float
    attn_implementation: str | None
    api: str  # "add_request" or "generate_batch (grouped by max_new_tokens)"
    version: str
    failed_requests: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def _keywords_only_taken(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, called with only the keyword arguments it takes (its signature read once; a
    dropped argument is logged once)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return function
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return function
    warned: set[str] = set()

    def call(**kwargs: Any) -> Any:
        dropped = set(kwargs) - set(parameters) - warned
        if dropped:
            warned.update(dropped)
            log.warning("transformers: arguments not taken by this version",
                        function=getattr(function, "__qualname__", repr(function)), dropped=sorted(dropped))
        return function(**{key: value for key, value in kwargs.items() if key in parameters})

    return call


def pick_attention(requested: str | None = None) -> str | None:
    """The paged SDPA attention of this transformers version: ``paged|sdpa`` where it is a key of
    ``ALL_ATTENTION_FUNCTIONS``; a key naming both paged and sdpa otherwise; plain ``sdpa`` where
    the paged prefix has been dropped (continuous batching switches to paged itself)."""
    if requested:
        return requested
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        keys = list(ALL_ATTENTION_FUNCTIONS.keys())
    except Exception:  # an unexpected layout: let continuous batching choose
        log.warning("transformers: cannot list the attention functions", exc_info=True)
        return None
    if "paged|sdpa" in keys:
        return "paged|sdpa"
    paged_sdpa = [key for key in keys if "paged" in key and "sdpa" in key]
    if paged_sdpa:
        return paged_sdpa[0]
    return "sdpa" if "sdpa" in keys else None


def _load_model(
    model_path: str, random_weights: bool, attn_implementation: str | None, seed: int, device: str
) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model: Any
    extra: dict[str, Any] = {}
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    if random_weights:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **extra)
            except TypeError:  # older spelling
                model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, **extra)
        model = model.to(device=device, dtype=torch.bfloat16)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, **extra)
        except TypeError:
            model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.bfloat16, **extra)
        model = model.to(device)
    return model.eval()


def _generation_config(max_new_tokens: int, temperature: float) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        eos_token_id=NO_EOS, pad_token_id=0,
    )


def _cb_objects(
    seed: int, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """``continuous_batching_config`` (its defaults, the seed, ``overrides``) and ``workload_hints``
    where this version has them."""
    objects: dict[str, Any] = {}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        objects["continuous_batching_config"] = _keywords_only_taken(ContinuousBatchingConfig)(
            **{"seed": seed, **overrides})
    except ImportError:
        pass
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        objects["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(p) for p in prompts),
            max_generated_length=max(max_tokens),
            num_requests=len(prompts),
        )
    except ImportError:
        pass
    return objects


def _wait(manager: Any, request_ids: set[str], timeout_s: float) -> dict[str, Any]:
    """Finished results of ``request_ids``; raises when the loop dies or ``timeout_s`` passes."""
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(request_ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' generation loop stopped with "
                                   f"{len(request_ids) - len(results)} requests unfinished")
            if time.monotonic() > deadline:
                raise TimeoutError(f"transformers peer: {len(request_ids) - len(results)} requests "
                                   f"unfinished after {timeout_s:.0f} s")
            continue
        if result.request_id in request_ids and result.is_finished():
            results[result.request_id] = result
    return results


def _run_add_request(
    model: Any, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], temperature: float, seed: int,
    warmup_requests: int, timeout_s: float, capture: bool, cb_overrides: Mapping[str, Any],
) -> tuple[float, list[Any]]:
    generation_config = _generation_config(max(max_tokens), temperature)
    context = _keywords_only_taken(model.continuous_batching_context_manager)
    with context(generation_config=generation_config, block=True, timeout=30, warmup=capture,
                 **_cb_objects(seed, prompts, max_tokens, cb_overrides)) as manager:
        add = _keywords_only_taken(manager.add_request)
        if warmup_requests > 0:
            warmup_ids = [f"warmup-{i}" for i in range(warmup_requests)]
            for index, request_id in enumerate(warmup_ids):
                add(input_ids=list(prompts[index % len(prompts)][:64]), request_id=request_id, max_new_tokens=8,
                    eos_token_id=NO_EOS)
            _wait(manager, set(warmup_ids), timeout_s)
        ids = [f"peer-{i}" for i in range(len(prompts))]
        inputs = [list(prompt) for prompt in prompts]
        start = time.perf_counter()
        for request_id, prompt, limit in zip(ids, inputs, max_tokens, strict=True):
            add(input_ids=prompt, request_id=request_id, max_new_tokens=limit, eos_token_id=NO_EOS)
        results = _wait(manager, set(ids), timeout_s)
        seconds = time.perf_counter() - start
    return seconds, [results[request_id] for request_id in ids]


def _run_grouped(
    model: Any, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], temperature: float,
) -> tuple[float, list[Any]]:
    """Fallback: one ``generate_batch`` per distinct ``max_new_tokens``."""
    groups: dict[int, list[list[int]]] = defaultdict(list)
    for prompt, limit in zip(prompts, max_tokens, strict=True):
        groups[limit].append(list(prompt))
    model.generate_batch(inputs=[list(prompts[0][:64])], generation_config=_generation_config(8, temperature))
    outputs: list[Any] = []
    start = time.perf_counter()
    for limit, inputs in groups.items():
        results = model.generate_batch(inputs=inputs, generation_config=_generation_config(limit, temperature))
        outputs.extend(results.values())
    return time.perf_counter() - start, outputs


def _per_request_max_new_tokens() -> bool:
    """Whether this version's manager takes ``max_new_tokens`` per request."""
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:
        return False
    return "max_new_tokens" in inspect.signature(ContinuousBatchingManager.add_request).parameters


def run_transformers_peer(
    model_path: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    random_weights: bool,
    temperature: float = 0.6,
    seed: int = 0,
    attn_implementation: str | None = None,
    warmup_requests: int = 4,
    timeout_s: float = 1800.0,
    device: str = "cuda",
    capture: bool = True,
    cb_overrides: Mapping[str, Any] | None = None,
) -> PeerResult:
    """Generate the requests with transformers' continuous batching on CUDA; time and count them.
    ``capture``: let the manager pre-capture its CUDA graphs before the warm-up requests;
    ``cb_overrides``: fields of transformers' ``ContinuousBatchingConfig`` (default: its own
    choices, sized from the GPU's free memory). ``device="cpu"``, ``capture=False`` and small
    ``cb_overrides`` exist for tests of the API calls, not for measurements."""
    import torch
    import transformers

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("the transformers peer needs a CUDA device")
    attention = pick_attention(attn_implementation)
    log.info("transformers peer", version=transformers.__version__, attn_implementation=attention,
             model=model_path, random_weights=random_weights, requests=len(prompts))
    model = _load_model(model_path, random_weights, attention, seed, device)
    try:
        if _per_request_max_new_tokens() and hasattr(model, "continuous_batching_context_manager"):
            api = "add_request"
            seconds, outputs = _run_add_request(model, prompts, max_tokens, temperature, seed, warmup_requests,
                                                timeout_s, capture, cb_overrides or {})
        else:
            api = "generate_batch (grouped by max_new_tokens)"
            seconds, outputs = _run_grouped(model, prompts, max_tokens, temperature)
    finally:
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    failed = sum(1 for output in outputs if getattr(output, "error", None))
    produced = sum(len(output.generated_tokens) for output in outputs)
    result = PeerResult(
        name="transformers", num_requests=len(prompts), output_tokens=produced,
        expected_output_tokens=sum(max_tokens), seconds=seconds, attn_implementation=attention, api=api,
        version=transformers.__version__, failed_requests=failed,
    )
    if produced != result.expected_output_tokens or failed:
        log.warning("transformers peer: output differs from the workload", produced=produced,
                    expected=result.expected_output_tokens, failed=failed)
    log.info("transformers peer done", tokens=produced, seconds=round(seconds, 2),
             tok_s=round(result.tokens_per_s, 1))
    return result
