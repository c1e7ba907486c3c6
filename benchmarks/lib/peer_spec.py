"""vLLM's side of ``benchmarks/spec_decode.py``: vLLM's offline ``LLM`` without and with n-gram,
draft-model or EAGLE-3 speculation on the same prompts, measured by ``spec_measure.measure``, with vLLM's
speculative-decoding counters per phase (``phase_drafting``, read by ``spec_counters.VllmCounters``
from ``LLM.get_metrics()``; stats logging on unless the workload's ``vllm_stats`` is false). Runs as a
script under vLLM's environment with spec_measure.py and spec_counters.py beside it, importing nothing
of vllm_actors: ``python3 peer_spec.py --model DIR --prompts P.json --out R.json``."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spec_measure, beside this file
import spec_counters  # noqa: E402
import spec_measure  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON: prompts (token ids), output_len, repeats, "
                        "concurrency, speculative_config")
    parser.add_argument("--mode", choices=["off", "ngram", "draft", "eagle3"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="an engine running at most N requests, measured on the queued phase only "
                             "(``spec_measure.queued``: the workload's ``queued_rounds`` calls)")
    args = parser.parse_args(argv)
    import vllm
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(args.prompts).read_text())
    speculative_config = spec.get("speculative_configs", {"ngram": spec["speculative_config"]}).get(args.mode)
    stats = bool(spec.get("vllm_stats", True))  # get_metrics() needs stats logging
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=spec["max_model_len"],
              speculative_config=speculative_config, enable_prefix_caching=False,
              load_format=spec.get("load_format", "auto"), skip_tokenizer_init=not spec.get("tokenizer", True),
              disable_log_stats=not stats, **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}))

    def generate(batch: Sequence[Sequence[int]], max_tokens: int) -> tuple[int, float]:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
        inputs: list[Any] = [{"prompt_token_ids": list(p)} for p in batch]
        return spec_measure.timed(lambda: sum(len(o.outputs[0].token_ids)
                                              for o in llm.generate(inputs, params, use_tqdm=False)))

    result: dict[str, Any] = {"engine": "vllm", "version": vllm.__version__, "mode": args.mode,
                              "log_stats": stats}
    if args.max_num_seqs:  # the queued phase alone: N running, a queue behind
        spec_measure.warm_up(generate, spec["prompts"])
        found = [spec_measure.queued(generate, spec["prompts"], args.max_num_seqs, spec["output_len"])[0]
                 for _ in range(int(spec.get("queued_rounds", 1)))]
        result[f"queued_{args.max_num_seqs}_tok_s"] = statistics.median(found)
        result["rounds"] = {f"queued_{args.max_num_seqs}_tok_s": found}
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    counters = spec_counters.VllmCounters(llm)
    if not stats:
        counters.note = "unavailable: stats logging off (vllm_stats false)"
    counters()  # a probe: a vLLM without get_metrics is noted here, before any phase
    result.update(spec_measure.measure(generate, spec["prompts"], spec["output_len"], spec["repeats"],
                                       spec["concurrency"], counters if counters.note is None else None,
                                       batch_repeats=spec.get("batch_repeats", 1)))
    result["spec_decode"] = counters()
    if counters.note is not None:  # failed before or during the phases: their differences mean nothing
        result.pop("phase_drafting", None)
        result["spec_decode"] = counters.note
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
