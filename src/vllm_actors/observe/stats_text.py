"""The human-readable summary of the metrics store that ``vllm-actors stats`` prints."""

from __future__ import annotations

from vllm_actors.protocol.metrics import Percentiles, SummaryReply


def _format_percentiles(name: str, values: Percentiles, scale: float, unit: str) -> str:
    if values.count == 0:
        return f"  {name:<10} {0:>8}        -"
    shown = (values.mean, values.p50, values.p90, values.p99, values.max)
    cells = " ".join(f"{value * scale:>9.2f}" for value in shown)
    return f"  {name:<10} {values.count:>8} {cells} {unit}"


def _format_reasons(reasons: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items())) or "-"


def summary_text(reply: SummaryReply) -> str:
    """The human-readable summary ``vllm-actors stats`` prints (multi-line, no trailing newline)."""
    gaps = sum(seen.gaps for seen in reply.actors.values())
    missed = sum(seen.missed for seen in reply.actors.values())
    lines = [
        f"events     {reply.num_events} in {reply.num_batches} batches ({reply.num_retained} retained), "
        f"{gaps} gaps ({missed} events missed)",
        f"requests   arrived {reply.requests_arrived}, running {reply.running}, waiting {reply.waiting}, "
        f"open {reply.open_requests}",
        f"           finished {reply.requests_finished} ({_format_reasons(reply.finished_by_reason)}), "
        f"aborted {reply.requests_aborted} ({_format_reasons(reply.aborted_by_reason)})"
        + (f", interrupted by a restart {reply.requests_interrupted}" if reply.requests_interrupted else "")
        + (f", lost {reply.requests_lost}" if reply.requests_lost else "")
        + (f", dropped {reply.requests_evicted}" if reply.requests_evicted else ""),
        f"tokens     prompt {reply.prompt_tokens}, generated {reply.generation_tokens}, "
        f"prefill computed {reply.prefill_tokens}, recomputed {reply.recomputed_tokens}",
        f"steps      {reply.steps} ({reply.step_tokens} tokens), prefill chunks {reply.prefill_chunks}, "
        f"preemptions {reply.preemptions}",
        f"kv cache   {reply.kv_blocks_in_use}/{reply.kv_blocks_total} blocks in use ({reply.kv_usage:.1%}), "
        f"{reply.kv_blocks_cached} cached, {reply.kv_blocks_evicted} evicted",
        f"prefix     {reply.prefix_cache_hits}/{reply.prefix_cache_queries} tokens hit "
        f"({reply.prefix_cache_hits / reply.prefix_cache_queries if reply.prefix_cache_queries else 0.0:.1%})",
        f"latency    {'count':>8} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}",
        _format_percentiles("ttft", reply.ttft, 1e3, "ms"),
        _format_percentiles("itl", reply.itl, 1e3, "ms"),
        _format_percentiles("e2e", reply.e2e, 1.0, "s"),
        _format_percentiles("queue", reply.queue, 1e3, "ms"),
        _format_percentiles("step", reply.step_ms, 1.0, "ms"),
    ]
    if reply.pipeline_bubbles:
        lines.append("pipeline   bubble fraction " + ", ".join(f"{stage} {fraction:.1%}"
                                                           for stage, fraction in reply.pipeline_bubbles.items()))
    if reply.actor_failures or reply.actor_restarts or reply.pipeline_resets or reply.group_failed:
        restarts = reply.restart_seconds
        lines.append(
            f"recovery   failures {_format_reasons(reply.actor_failures)}; restarts "
            f"{_format_reasons(reply.actor_restarts)}"
            + (f" (mean {restarts.mean:.2f} s, max {restarts.max:.2f} s)" if restarts.count else "")
            + f"; pipeline resets {reply.pipeline_resets}"
            + (f"; GROUP FAILED: {reply.group_failed}" if reply.group_failed else "")
        )
    if reply.rejected_batches or reply.rejected_events:
        lines.append(f"untrusted  {reply.rejected_batches} batches under another actor's id, "
                     f"{reply.rejected_events} engine events from clients: not applied")
    lines.append("actors")
    if not reply.actors:
        lines.append("  (none seen)")
    width = max((len(actor) for actor in reply.actors), default=0)
    for actor, seen in reply.actors.items():
        line = (f"  {actor:<{width}}  {seen.state or '?':<8} seq {seen.last_seq}, {seen.num_events} events, "
                f"{seen.gaps} gaps ({seen.missed} missed)")
        if seen.stale_batches:
            line += f", {seen.stale_batches} stale batches"
        if seen.restarts:
            line += f", {seen.restarts} restarts"
        if seen.rejected_events:
            line += f", {seen.rejected_events} events rejected"
        if seen.crashes:
            line += f", {seen.crashes} crashes, last: {seen.error}"
        lines.append(line)
    return "\n".join(lines)
