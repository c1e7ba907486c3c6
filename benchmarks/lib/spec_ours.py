"""This engine's side of ``benchmarks/spec_decode.py``: one ``LLM`` per mode, started side by side on
the same GPU and measured in paired rounds (``spec_paired.py``).

Each engine's KV pool sizing reads the device's free memory, so ``gpu_memory_utilization`` bounds
what every process on the GPU holds together: the i-th of n engines gets ``(i + 1) / n`` of the
share, which leaves each about ``1 / n`` of it. ``paired=False`` runs the modes one after another
instead, each engine alone with the whole share (a model too large to hold twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.lib import spec_measure, spec_oracle, spec_paired, spec_queued
from vllm_actors.bench.engine_env import engine_environment


def engine_shares(utilization: float, count: int) -> list[float]:
    """Each engine's ``gpu_memory_utilization``, started in order: a cumulative 1/count of ``utilization``."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return [utilization * (index + 1) / count for index in range(count)]


def run_ours(model: str, spec: dict[str, Any], modes: Sequence[str], rounds: int, utilization: float,
             paired: bool = True, record: bool = False,
             events_dir: Path | None = None) -> tuple[dict[str, dict[str, Any]], list[list[int]]]:
    """Every mode's figures (``spec_paired.measure_paired``) and, with ``record``, each batch-1 prompt's
    greedy output without speculation (the oracle's continuations; the mode ``off`` must be among them).
    ``events_dir``: each mode's event log dumped there at the end (``MODE.jsonl``: its steps, timed)."""
    groups = [list(modes)] if paired else [[mode] for mode in modes]
    results: dict[str, dict[str, Any]] = {}
    recorded: list[list[int]] = []
    for group in groups:
        with ExitStack() as stack:
            llms = start_group(stack, model, spec, group, utilization)
            generates = {mode: generator(llm) for mode, llm in llms.items()}
            counters = {mode: (lambda llm=llm: spec_oracle.counts(llm)) for mode, llm in llms.items()}
            found = spec_paired.measure_paired(generates, spec["prompts"], spec["output_len"], spec["repeats"],
                                               spec["concurrency"], rounds, counters,
                                               batch_repeats=spec.get("batch_repeats", 1))
            for mode, llm in llms.items():
                found[mode]["spec_decode"] = spec_oracle.counts(llm)
                if events_dir is not None:
                    dump_events(llm, events_dir / f"{mode}.jsonl")
                found[mode]["gpu_memory_utilization"] = llm.config.gpu_memory_utilization
            if record and "off" in llms:
                recorded = spec_oracle.greedy_outputs(llms["off"], spec_oracle.batch1_prompts(spec),
                                                      spec["output_len"])
        results.update(found)
    for slots in spec.get("queued", []):  # engines of max_num_seqs N, a queue behind (spec_queued)
        for group in groups:
            with ExitStack() as stack:
                llms = start_group(stack, model, spec, group, utilization, max_num_seqs=slots)
                queued = spec_queued.measure_queued({mode: generator(llm) for mode, llm in llms.items()},
                                                    spec["prompts"], slots, spec["output_len"], rounds)
            for mode, found_queued in queued.items():
                merged = results[mode]
                merged[f"queued_{slots}_tok_s"] = found_queued[f"queued_{slots}_tok_s"]
                merged.setdefault("rounds", {}).update(found_queued["rounds"])
                if "ratio" in found_queued:
                    merged.setdefault("paired_vs_off", {}).update(found_queued["ratio"])
    return results, recorded


def start_group(stack: ExitStack, model: str, spec: dict[str, Any], group: Sequence[str], utilization: float,
                max_num_seqs: int | None = None) -> dict[str, Any]:
    """An engine per mode of ``group`` side by side (``engine_shares``), closed with ``stack``."""
    return {mode: stack.enter_context(start(model, spec, mode, share, max_num_seqs))
            for mode, share in zip(group, engine_shares(utilization, len(group)), strict=True)}


def dump_events(llm: Any, path: Path) -> None:
    """The metrics store's event log (bounded: ``VLLM_ACTORS_METRICS_MAX_EVENTS``) saved at ``path``."""
    from vllm_actors.observe.tap import save_dump
    from vllm_actors.protocol.metrics import DumpQuery, DumpReply

    path.parent.mkdir(parents=True, exist_ok=True)
    reply = llm.engine.query_metrics(DumpQuery())
    if not isinstance(reply, DumpReply):
        raise RuntimeError(f"the metrics store could not dump its event log: {reply!r}")
    save_dump(reply, path.resolve())


def start(model: str, spec: dict[str, Any], mode: str, utilization: float, max_num_seqs: int | None = None) -> Any:
    """An engine in ``mode`` (``spec["speculative_configs"]``; ``always_draft``: every step drafts k;
    ``ngram-overlap``: n-gram with ``VLLM_ACTORS_SPEC_OVERLAP=1``); ``max_num_seqs``: the requests it runs at once."""
    from vllm_actors import LLM
    from vllm_actors.protocol.speculative import parse_speculative_config

    speculative = spec["speculative_configs"].get(mode)
    if speculative is not None:  # --always-draft: every step (as vLLM does), to measure the step cost
        speculative = parse_speculative_config(speculative, adaptive=not spec.get("always_draft", False))
    overlap = {"VLLM_ACTORS_SPEC_OVERLAP": "1"} if mode == "ngram-overlap" else {}  # its processes inherit it
    with engine_environment(overlap):
        return LLM(model, dtype="auto", max_model_len=spec["max_model_len"], enable_prefix_caching=False,
                   load_format=spec["load_format"], skip_tokenizer_init=not spec["tokenizer"],
                   speculative_config=speculative, gpu_memory_utilization=utilization,
                   **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}))


def generator(llm: Any) -> spec_measure.Generate:
    """``spec_measure``'s generate over ``llm``: greedy, EOS ignored, the tokens and seconds of one call."""
    from vllm_actors import SamplingParams

    def generate(batch: Sequence[Sequence[int]], max_tokens: int) -> tuple[int, float]:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        inputs = [{"prompt_token_ids": list(p)} for p in batch]
        return spec_measure.timed(lambda: sum(len(o.outputs[0].token_ids)
                                              for o in llm.generate(inputs, params, use_tqdm=False)))

    return generate
