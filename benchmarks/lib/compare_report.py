"""The throughput benchmark's report with its comparisons: the GPU's floor and ceilings, the
transformers, vLLM and SGLang peers, and batch-1 by the client's clock (rows, bars and
``results.json`` keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.lib.floor import Floor, GpuCeilings
from benchmarks.lib.peer_transformers import PeerResult
from vllm_actors.bench.report import BenchReport

_KEY_ORDER = (
    "config", "ours", "floor", "fraction_of_floor", "ceilings", "peer", "peer_ratio", "metrics", "batch1", "errors",
    "total_seconds", "ours_runs", "startup_s", "batch1_client", "peer_vllm", "vllm_ratio", "peer_sglang",
    "sglang_ratio", "best_peer", "steps",
)
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}  # the separate-process peers, in the order they run


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


@dataclass
class ComparisonReport(BenchReport):
    ceilings: GpuCeilings | None = None
    floor: Floor | None = None
    peer: PeerResult | None = None
    batch1_client: dict[str, Any] | None = None  # client-clock batch-1 (peer_common.client_batch1)
    peer_vllm: dict[str, Any] | None = None  # peer_vllm.py's result
    peer_sglang: dict[str, Any] | None = None  # peer_sglang.py's result

    def engine_peers(self) -> dict[str, dict[str, Any]]:
        """The separate-process peers that ran: engine -> its result."""
        found = {engine: getattr(self, f"peer_{engine}") for engine in ENGINE_NAMES}
        return {engine: result for engine, result in found.items() if result}

    def ratio_to(self, engine: str) -> float | None:
        """Our output tok/s over ``engine``'s."""
        peer = getattr(self, f"peer_{engine}")
        if self.ours is None or not peer or not peer.get("tokens_per_s"):
            return None
        return self.ours.tokens_per_s / float(peer["tokens_per_s"])

    @property
    def vllm_ratio(self) -> float | None:
        return self.ratio_to("vllm")

    @property
    def sglang_ratio(self) -> float | None:
        return self.ratio_to("sglang")

    @property
    def best_peer(self) -> dict[str, Any] | None:
        """Against the better of the engine peers: output tok/s, batch-1 TTFT and decode, each
        ours over the best peer's figure (tok/s: above 1 is ahead; times: below 1 is ahead)."""
        peers = self.engine_peers()
        if not peers:
            return None
        best: dict[str, Any] = {}
        rated = {e: float(r["tokens_per_s"]) for e, r in peers.items() if r.get("tokens_per_s")}
        if rated and self.ours is not None:
            engine = max(rated, key=lambda e: rated[e])
            best["tokens_per_s"] = {"engine": engine, "peer": rated[engine],
                                    "ours_over_peer": self.ours.tokens_per_s / rated[engine]}
        ours_b1 = self.batch1_client
        for key in ("ttft_s", "ms_per_token"):
            timed = {e: float(r["batch1"][key]) for e, r in peers.items() if r.get("batch1")}
            if timed and ours_b1:
                engine = min(timed, key=lambda e: timed[e])
                best[key] = {"engine": engine, "peer": timed[engine],
                             "ours_over_peer": float(ours_b1[key]) / timed[engine]}
        return best

    @property
    def fraction_of_floor(self) -> float | None:
        if self.ours is None or self.floor is None or self.floor.tokens_per_s <= 0:
            return None
        return self.ours.tokens_per_s / self.floor.tokens_per_s

    @property
    def peer_ratio(self) -> float | None:
        if self.ours is None or self.peer is None or self.peer.tokens_per_s <= 0:
            return None
        return self.ours.tokens_per_s / self.peer.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        merged = {
            **super().to_dict(),
            "floor": None if self.floor is None else self.floor.to_dict(),
            "fraction_of_floor": self.fraction_of_floor,
            "ceilings": None if self.ceilings is None else self.ceilings.to_dict(),
            "peer": None if self.peer is None else self.peer.to_dict(),
            "peer_ratio": self.peer_ratio,
            "batch1_client": self.batch1_client,
            "peer_vllm": self.peer_vllm,
            "vllm_ratio": self.vllm_ratio,
            "peer_sglang": self.peer_sglang,
            "sglang_ratio": self.sglang_ratio,
            "best_peer": self.best_peer,
        }
        return {key: merged[key] for key in _KEY_ORDER}

    def comparison_bars(self) -> list[tuple[str, float]]:
        bars: list[tuple[str, float]] = []
        if self.floor is not None:
            bars.append(("floor", self.floor.tokens_per_s))
        if self.peer is not None:
            bars.append((f"transformers\n({self.peer.num_requests} req)", self.peer.tokens_per_s))
        for engine, result in self.engine_peers().items():
            if result.get("tokens_per_s"):
                bars.append((f"{ENGINE_NAMES[engine]} {result.get('version', '')}", float(result["tokens_per_s"])))
        return bars

    def comparison_rows(self) -> list[tuple[str, str]]:
        rows = self._engine_rows()
        if self.floor is not None:
            floor = self.floor
            rows.append(("floor: output tok/s", f"{floor.tokens_per_s:,.0f} ({floor.seconds:.2f} s: prefill "
                                                f"{floor.prefill_seconds:.2f} s + {floor.decode_steps} decode steps "
                                                f"{floor.decode_seconds:.2f} s)"))
            if self.fraction_of_floor is not None:
                rows.append(("ours / floor", f"{self.fraction_of_floor:.1%}"))
            gpus = (f" a GPU, TP={floor.tensor_parallel_size} x PP={floor.pipeline_parallel_size}"
                    if floor.tensor_parallel_size * floor.pipeline_parallel_size > 1 else "")
            rows.append(("floor at", f"{floor.bandwidth / 1e12:.2f} TB/s, {floor.matmul_rate / 1e12:.0f} TFLOP/s"
                                     f"{gpus}"))
        if self.ceilings is not None:
            ceilings = self.ceilings
            rows.append(("measured copy bandwidth", f"{ceilings.bandwidth / 1e12:.2f} TB/s (read+write, "
                                                    f"{ceilings.copy_bytes / (1 << 30):.0f} GiB copy)"))
            rows.append(("measured bf16 matmul", f"{ceilings.matmul_rate / 1e12:.0f} TFLOP/s "
                                                 f"({ceilings.matmul_size}³)"))
            rows.append(("GPU", ceilings.device))
        if self.peer is not None:
            peer = self.peer
            rows.append((f"peer: transformers {peer.version}", f"{peer.tokens_per_s:,.0f} tok/s "
                                                              f"({peer.num_requests} requests, "
                                                              f"{peer.output_tokens:,} tokens, {peer.seconds:.1f} s, "
                                                              f"{peer.attn_implementation})"))
            if self.peer_ratio is not None:
                rows.append(("ours / peer (tok/s)", f"{self.peer_ratio:.2f}x"))
        return rows

    def _engine_rows(self) -> list[tuple[str, str]]:
        rows: list[tuple[str, str]] = []
        skew = self.config.get("router_skew")
        if skew:
            rows.append(("experts' routing", f"{skew['spec']}: the hottest expert {skew['hottest_over_uniform']:.1f}x "
                                             f"its uniform share, {skew['experts_taking_half_the_choices']} of "
                                             f"{skew['num_experts']} take half the choices"))
        ours_b1 = self.batch1_client
        if ours_b1:
            rows.append(("ours: batch-1 (client clock)", f"TTFT {_ms(ours_b1['ttft_s'])}, "
                                                         f"{ours_b1['ms_per_token']:.3f} ms/token"))
        for engine, peer in self.engine_peers().items():
            name = ENGINE_NAMES[engine]
            if peer.get("tokens_per_s"):
                runs = ", ".join(f"{run['tokens_per_s']:,.0f}" for run in peer.get("runs", []))
                rows.append((f"{name} {peer.get('version', '')}: output tok/s",
                             f"{peer['tokens_per_s']:,.0f} (runs: {runs}; {peer['output_tokens']:,} tokens)"))
            if peer.get("startup_s") is not None:
                rows.append((f"{name}: engine start", f"{peer['startup_s']:.1f} s"))
            if peer.get("router_skew"):
                rows.append((f"{name}: skewed routers", f"{peer['router_skew']['spec']}, "
                                                        f"{peer['router_skew']['skewed_gates_per_worker']} per worker"))
            if peer.get("settings"):
                rows.append((f"{name}: settings", ", ".join(f"{k}={v}" for k, v in peer["settings"].items())))
            if peer.get("batch1"):
                b1 = peer["batch1"]
                rows.append((f"{name}: batch-1 (client clock)",
                             f"TTFT {_ms(b1['ttft_s'])}, {b1['ms_per_token']:.3f} ms/token"))
            ratio = self.ratio_to(engine)
            if ratio is not None:
                rows.append((f"ours / {name} (tok/s)", f"{ratio:.3f}"))
            if peer.get("error"):
                rows.append((f"error: {name}", str(peer["error"])))
        best = self.best_peer or {}
        for key, label in (("tokens_per_s", "tok/s"), ("ttft_s", "batch-1 TTFT"), ("ms_per_token", "batch-1 decode")):
            if key in best:
                entry = best[key]
                rows.append((f"ours / best peer ({label})",
                             f"{entry['ours_over_peer']:.3f} (best: {ENGINE_NAMES[entry['engine']]})"))
        return rows
