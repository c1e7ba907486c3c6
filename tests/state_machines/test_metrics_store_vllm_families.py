"""What the metrics store keeps for vLLM's families that only the engine's events can feed:
tokens per step (``vllm:iteration_tokens_total``) and prompt tokens by source
(``vllm:prompt_tokens_by_source``, ``vllm:prompt_tokens_cached``)."""

from __future__ import annotations

from itertools import pairwise

from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.protocol.events import Arrived, Event, EventBatch, Preempted, Resumed, Scheduled, StepFinished, Tokens
from vllm_actors.protocol.metrics import ITERATION_TOKENS_BUCKETS, SummaryReply

# vLLM 0.26, vllm/v1/metrics/loggers.py: histogram_iteration_tokens' buckets.
VLLM_ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class Publisher:
    def __init__(self, store: MetricsStore) -> None:
        self.store, self.seq = store, {}

    def __call__(self, actor: str, *events: Event) -> SummaryReply:
        seq = self.seq.get(actor, 0)
        self.seq[actor] = seq + len(events)
        self.store.record(EventBatch(actor=actor, first_seq=seq, mono=float(seq), wall=1e9 + seq, events=list(events)))
        return self.store.summary()


def test_tokens_per_step_in_vllms_buckets() -> None:
    publish = Publisher(MetricsStore())
    assert list(ITERATION_TOKENS_BUCKETS) == VLLM_ITERATION_TOKENS_BUCKETS
    # a step's sampled tokens plus the computed prompts of the requests it sampled a first token for
    for step, prompt in enumerate((0, 7, 8, 299, 16383, 19999)):
        reply = publish("scheduler", Tokens(step_id=step, request_ids=["a"], num_output_tokens=[1],
                                            num_computed_prompt_tokens=prompt))
    # the worker's steps (the tokens it ran through the model) are the store's own count only
    reply = publish("worker-0", StepFinished(step_id=0, num_seqs=1, num_tokens=500, num_sampled=1, execute_ms=1.0))
    assert reply.step_tokens == 500
    histogram = reply.step_tokens_histogram
    assert histogram.bounds == VLLM_ITERATION_TOKENS_BUCKETS
    counts = dict(zip([*histogram.bounds, "inf"], histogram.counts, strict=True))
    assert counts[1] == 1 and counts[8] == 1 and counts[16] == 1 and counts[512] == 1 and counts[16384] == 1
    assert counts["inf"] == 1 and sum(histogram.counts) == histogram.count == 6
    assert histogram.total == 1 + 8 + 9 + 300 + 16384 + 20000


def test_prompt_tokens_by_source_once_per_request_whatever_the_order_of_arrival_and_admission() -> None:
    publish = Publisher(MetricsStore())
    replies = [
        publish("frontend-a", Arrived(request_id="a", num_prompt_tokens=100, max_tokens=8)),
        publish("scheduler", Scheduled(request_id="a", step_id=0, num_query_tokens=100, num_cached_tokens=64)),
        # b's admission reaches the store before its arrival (two actors, no order between them)
        publish("scheduler", Scheduled(request_id="b", step_id=1, num_query_tokens=50, num_cached_tokens=32)),
        publish("frontend-a", Arrived(request_id="b", num_prompt_tokens=50, max_tokens=8)),
        # a preempted and resumed: its second lookup counts as a prefix-cache query, not as more prompt
        publish("scheduler", Preempted(request_id="a", step_id=2, num_computed_tokens=100),
                Resumed(request_id="a", step_id=3, num_query_tokens=104, num_cached_tokens=96)),
        publish("frontend-a", Arrived(request_id="c", num_prompt_tokens=7, max_tokens=8)),
    ]
    last = replies[-1]
    assert last.prompt_tokens_cached == 64 + 32
    assert last.prompt_tokens_computed == (100 - 64) + (50 - 32)  # c is not admitted yet
    assert last.prompt_tokens == 157 and last.prefix_cache_hits == 64 + 32 + 96
    for before, after in pairwise(replies):  # counters: they only grow
        assert after.prompt_tokens_cached >= before.prompt_tokens_cached
        assert after.prompt_tokens_computed >= before.prompt_tokens_computed


def test_spec_decode_counters_from_the_steps_in_vllms_families() -> None:
    """STEP_FINISHED's drafted and accepted counts summed by the store and served under vLLM's
    spec_decode names (the per-position counter labelled by position); none before a draft."""
    from vllm_actors.server.metrics_summary import SummaryCollector

    publish = Publisher(MetricsStore())
    collector = SummaryCollector("m")
    collector.summary = publish("worker-0", StepFinished(step_id=0, num_seqs=1, num_tokens=1, num_sampled=1,
                                                         execute_ms=1.0))
    assert not [f for f in collector.collect() if f.name.startswith("vllm:spec_decode")]
    publish("worker-0", StepFinished(step_id=1, num_seqs=2, num_tokens=9, num_sampled=5, execute_ms=1.0,
                                     num_drafts=2, num_draft_tokens=7, num_accepted_tokens=3,
                                     accepted_per_pos=[2, 1, 0, 0]))
    collector.summary = publish("worker-0", StepFinished(step_id=2, num_seqs=1, num_tokens=3, num_sampled=2,
                                                         execute_ms=1.0, num_drafts=1, num_draft_tokens=2,
                                                         num_accepted_tokens=1, accepted_per_pos=[1, 0]))
    spec = collector.summary.spec_decode
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (3, 9, 4)
    assert spec.accepted_per_pos == [3, 1, 0, 0]
    found = {f.name: f for f in collector.collect()}
    values = {name: [(dict(s.labels).get("position"), s.value) for s in found[name].samples
                     if s.name.endswith("_total")]
              for name in found if name.startswith("vllm:spec_decode")}
    assert values == {
        "vllm:spec_decode_num_drafts": [(None, 3)],
        "vllm:spec_decode_num_draft_tokens": [(None, 9)],
        "vllm:spec_decode_num_accepted_tokens": [(None, 4)],
        "vllm:spec_decode_num_accepted_tokens_per_pos": [("0", 3), ("1", 1), ("2", 0), ("3", 0)],
    }
