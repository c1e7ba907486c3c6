"""The engine paths' settings, switches for debugging and measuring (group ``engine``)."""

from __future__ import annotations

from vllm_actors.envs.parsers import choice
from vllm_actors.envs.setting import Setting, kernel_switch, switch
from vllm_actors.models.router_skew import RouterSkew, parse_skew


class EngineSettings:
    """The ``engine`` group's settings (``Envs`` inherits them)."""

    VLLM_ACTORS_DEFER_STEPS = switch("The worker launches a step and reads its tokens back at the next one.", "engine")
    VLLM_ACTORS_PADDED_GRAPHS = switch(
        "Prefill and mixed steps replay CUDA graphs padded to the next token count.", "engine")
    VLLM_ACTORS_GRAPH_SAMPLER = switch(
        "Decode graphs also draw the tokens where every row needs only the fused sampler.", "engine")
    VLLM_ACTORS_TP_GRAPH_SAMPLER = switch(
        "Every tensor-parallel rank draws a sampling graph's tokens itself (0: rank 0 broadcasts).", "engine")
    VLLM_ACTORS_SPEC_ADAPTIVE = switch(
        "Speculative decoding drafts per step as many tokens as the step cost model and the observed acceptance "
        "say pay (0: always `num_speculative_tokens` where a draft is found).", "engine")
    VLLM_ACTORS_SPEC_OVERLAP = switch(
        "An n-gram verification step is read back after the next step is launched, that step's rows of the "
        "drafting requests moved on the device by their accepted counts (off until measured on a GPU: read back "
        "at once; speculative.md).", "engine", default=False)
    VLLM_ACTORS_ALLOW_ORACLE_DRAFTER = switch(
        "Accept the speculative method `oracle`, which replays given greedy continuations at a set acceptance "
        "(benchmarks only: it measures the verification cost; see speculative.md).", "engine", default=False)
    VLLM_ACTORS_MOE_ROUTER_SKEW = Setting[RouterSkew | None](
        None, parse_skew, "Benchmarks only: mixture-of-experts routers choose experts Zipf-distributed (`zipf:S`: "
        "expert e with weight (e+1)^-S, drawn from a fixed table, as `benchmarks/throughput.py --moe-router-skew` "
        "sets it for both engines); unset: the model's own routing.", kind="zipf:S", group="engine")
    VLLM_ACTORS_DUMMY_WEIGHTS = Setting(
        "random", choice("random", "echo"), "Benchmarks only: the weights of `load_format=dummy`: random, or `echo` "
        "(residual projections scaled down, LM head equal to the embedding: greedy decoding repeats the last "
        "token by a wide logit margin under any kernel; the same shapes and cost; `models/echo_weights.py`).",
        kind="random, echo", group="engine")
    VLLM_ACTORS_SAMPLER = kernel_switch("Fused sampling kernel", "engine")
    VLLM_ACTORS_PENALTIES = kernel_switch("Penalties kernel", "engine")
