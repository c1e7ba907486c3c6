"""vLLM's side of ``benchmarks/throughput.py --moe-router-skew``: its Qwen3-MoE routers choose experts
as ours do under ``VLLM_ACTORS_MOE_ROUTER_SKEW`` (``router_skew.py``, copied beside this file).

vLLM's ``Qwen3MoeSparseMoeBlock`` runs ``router_logits, _ = self.gate(hidden_states)`` (a
``ReplicatedLinear``), then its ``FusedMoE`` takes the softmax's top-k, renormalised by
``norm_topk_prob`` (and where the gate is handed to the ``FusedMoE``, its runner calls the same module).
``install`` wraps the block's ``__init__`` so that each gate built afterwards gets a subclass whose
``forward`` runs the gate, then returns the skewed table's rows for the step in its place, as our
``SparseMoeBlock`` does; the table is a buffer of the gate, the layer read from the block's prefix.

The gates must be built after ``install``: in this process, or in a process forked from it (vLLM's
engine core and workers, ``ENV``'s ``VLLM_WORKER_MULTIPROC_METHOD=fork``), and traced by torch.compile
afresh (``VLLM_DISABLE_COMPILE_CACHE``). ``fill_in_workers`` then copies the table into every skewed
gate of every worker (in place: captured CUDA graphs read the same memory) and counts them; none found
is an error, not a uniform run under a skewed name.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

try:
    import router_skew  # beside this file in the peer's folder
except ImportError:  # in the repository (tests)
    from vllm_actors.models import router_skew

# vLLM's settings for a skewed run (merged into the peer's environment)
ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_DISABLE_COMPILE_CACHE": "1",
       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the last: collective_rpc with a function
_LAYER = re.compile(r"layers\.(\d+)(\.|$)")
_CLASSES: dict[type, type] = {}


def skewed_gate_class(base: type) -> type:
    """``base`` (vLLM's gate class) with the skewed table's rows in place of its output logits."""
    if base not in _CLASSES:
        def forward(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            out = base.forward(self, x, *args, **kwargs)
            logits = out[0] if isinstance(out, tuple) else out
            skewed = router_skew.skewed_logits(self.router_skew_table, logits.shape[0], self.router_skew_layer,
                                               logits.dtype)
            return (skewed, *out[1:]) if isinstance(out, tuple) else skewed

        _CLASSES[base] = type(f"Skewed{base.__name__}", (base,), {"forward": forward, "router_skew": True})
    return _CLASSES[base]


def skew_gate(gate: Any, skew: router_skew.RouterSkew, layer: int) -> None:
    """Turn one gate module into a skewed one (its class, a buffer holding the table, its layer)."""
    device = gate.weight.device
    table = router_skew.make_table(skew, int(gate.weight.shape[0]), "cpu")
    gate.__class__ = skewed_gate_class(type(gate))
    gate.register_buffer("router_skew_table", table.to(device) if device.type != "meta" else
                         table.to("meta"), persistent=False)  # filled again by fill_in_workers
    gate.router_skew_layer = layer
    gate.router_skew_spec = skew.spec


def layer_of(prefix: str) -> int:
    match = _LAYER.search(prefix)
    if match is None:
        raise ValueError(f"no layer index in the MoE block's prefix {prefix!r}")
    return int(match.group(1))


def install(skew: router_skew.RouterSkew, module: Any = None) -> None:
    """Every ``Qwen3MoeSparseMoeBlock`` of ``module`` (vLLM's qwen3_moe) built from now on routes by ``skew``."""
    if module is None:
        from vllm.model_executor.models import qwen3_moe as module
    block = module.Qwen3MoeSparseMoeBlock
    if getattr(block, "router_skew_installed", False):
        raise RuntimeError("the skewed router is installed already")
    original = block.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        skew_gate(self.gate, skew, layer_of(str(bound.arguments.get("prefix", ""))))

    block.__init__ = __init__
    block.router_skew_installed = True


def fill_gates(model: Any) -> int:
    """Copy the table into every skewed gate of ``model``; how many there are."""
    count = 0
    for module in model.modules():
        if getattr(module, "router_skew", False) is True:
            skew = router_skew.parse_skew(module.router_skew_spec)
            table = module.router_skew_table
            table.copy_(router_skew.make_table(skew, table.shape[1], "cpu").to(table.device))
            count += 1
    return count


def _fill_worker(worker: Any) -> int:
    """Run in each vLLM worker by ``collective_rpc``."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return fill_gates(model)


def fill_in_workers(llm: Any, skew: router_skew.RouterSkew) -> dict[str, Any]:
    """After ``LLM(...)``: the table in every worker's gates; the record for the results."""
    counts = [int(count) for count in llm.collective_rpc(_fill_worker)]
    if not counts or min(counts) == 0:
        raise RuntimeError(f"vLLM's workers hold no skewed router ({counts} gates per worker): the model is not "
                           "Qwen3-MoE, or its gates were built where install() did not reach (a spawned process)")
    return {"spec": skew.spec, "skewed_gates_per_worker": counts}
