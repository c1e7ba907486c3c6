"""What one long prompt's arrival costs each actor on this CPU (in process, token ids given, no
tokenizer): the frontend's prepare_tokens + submit, the AddRequest's msgpack encode and decode,
and the scheduler's handle of it (admission, prefix-cache lookup, first plan), into an empty
cache ("scheduler") and once the same prompt is cached ("hit": a second request after the first's
prefill). Prints the median of a few runs per prompt length, in milliseconds.
Usage: benchmarks/arrival_cost.py [lengths...]"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vllm_actors.actors.frontend.frontend import Frontend  # noqa: E402
from vllm_actors.actors.scheduler.scheduler import Scheduler  # noqa: E402
from vllm_actors.protocol.codec import MessageCodec  # noqa: E402
from vllm_actors.protocol.config import SchedulerConfig  # noqa: E402
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult  # noqa: E402
from vllm_actors.protocol.outputs import Outputs  # noqa: E402
from vllm_actors.protocol.sampling import SamplingParams  # noqa: E402

RUNS = 5


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000.0


def _prefill(scheduler: Scheduler, out: Outputs, request_id: str) -> None:
    """Answer the plans (one in flight) until the request has its one token: its blocks stay cached."""
    while plans := [message for _, message in out.messages if isinstance(message, StepPlan)]:
        (plan,) = plans
        request = scheduler.requests.get(request_id)
        sampled = [request_id] if request is not None and request.num_pending else []
        out = scheduler.handle(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=sampled,
                                          token_ids=[7] * len(sampled)))


def measure(num_tokens: int) -> dict[str, float]:
    prompt = [1 + i % 100_000 for i in range(num_tokens)]
    params = SamplingParams(max_tokens=4)
    codec = MessageCodec()
    times: dict[str, list[float]] = {"frontend": [], "encode": [], "decode": [], "scheduler": [], "hit": []}
    for run in range(RUNS):
        frontend = Frontend(None, [0], max_model_len=num_tokens + 16, vocab_size=128_000)
        start = time.perf_counter()
        out = frontend.submit(frontend.prepare_tokens(f"r{run}", None, prompt, params))
        times["frontend"].append(time.perf_counter() - start)
        add = next(message for _, message in out.messages if isinstance(message, AddRequest))
        start = time.perf_counter()
        data = codec.encode(add)
        times["encode"].append(time.perf_counter() - start)
        start = time.perf_counter()
        decoded = codec.decode(data)
        times["decode"].append(time.perf_counter() - start)
        scheduler = Scheduler(SchedulerConfig(
            max_model_len=num_tokens + 16, max_num_seqs=8, max_num_batched_tokens=8192, enable_chunked_prefill=True,
            block_size=128, num_blocks=num_tokens // 128 + 64, enable_prefix_caching=True, vocab_size=128_000,
            max_steps_in_flight=1))
        start = time.perf_counter()
        out = scheduler.handle(decoded)
        times["scheduler"].append(time.perf_counter() - start)
        if run == 0:  # the prefill takes seconds: one hit per length
            _prefill(scheduler, out, add.request_id)
            again = codec.decode(codec.encode(frontend.submit(frontend.prepare_tokens(
                "again", None, prompt, params)).messages[0][1]))
            start = time.perf_counter()
            scheduler.handle(again)
            times["hit"].append(time.perf_counter() - start)
    return {name: _median_ms(samples) for name, samples in times.items()}


def main() -> None:
    lengths = [int(arg) for arg in sys.argv[1:]] or [32_768, 1_000_000]
    print(f"{'tokens':>10} {'frontend':>9} {'encode':>8} {'decode':>8} {'scheduler':>10} {'hit':>7}"
          f"  (ms, median of {RUNS}; hit: one run)")
    for num_tokens in lengths:
        cost = measure(num_tokens)
        print(f"{num_tokens:>10} {cost['frontend']:>9.1f} {cost['encode']:>8.1f} {cost['decode']:>8.1f} "
              f"{cost['scheduler']:>10.1f} {cost['hit']:>7.1f}")


if __name__ == "__main__":
    main()
