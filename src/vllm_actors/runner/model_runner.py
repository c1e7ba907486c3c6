"""Model runner: the model's weights, the paged KV cache tensors, and one forward pass per step.

The worker hands it flattened batches (token ids, positions, block tables); it builds the attention
metadata, runs the model and returns the logits of the positions that were asked for.

On a GPU: the step's integer inputs go through pinned host buffers in one non-blocking copy each
(two sets in turn, so a step can be prepared while the previous one's copies may still be queued;
``step_inputs.py``, a set refilled only once its copies have run: ``staging.py``);
input ids that the previous step sampled and the host has not read yet (``DeferredInputs``) are
gathered from that step's sampled ids on the device. Decode steps (one new token per sequence)
replay a CUDA graph captured for the next batch-size bucket, padded rows writing nowhere (slot -1),
their inputs packed in one buffer moved by one copy (``graph_inputs.py``); so do verification steps
of speculative decoding, as one decode row per token (``verify_rows.py``); where the step's rows
need nothing but the fused sampling kernel, a second graph per bucket draws the tokens too
(``graph_draws.py``, for verification steps too; ``VLLM_ACTORS_GRAPH_SAMPLER=0`` turns it off).
Other steps (prefills, mixed) replay a graph of the whole forward pass padded to the next token
count (``padded_forward.py``). A step marked ``eager`` (one with a request on borrowed KV, whose
attention calls out to other replicas: ``kv_borrowing.py``) runs eagerly whatever its shape.
The KV pool takes what ``gpu_memory_utilization`` leaves after the weights and the peak activations
of a profiling pass of the largest step (twice that with padded graphs: their pool holds one more),
in blocks of ``kv_cache_dtype`` (an fp8 cache: half the bytes of bf16 a token, twice the tokens).
With ``calculate_kv_scales`` the first real step runs eagerly and sets the fp8 scales from its amax.
Sleep mode (``sleep_mode.py``) frees the weights and the KV cache and brings them back; the CUDA
graphs are captured again after a wake. A draft model or an EAGLE-3 head (speculative decoding) runs
beside the model in ``drafter`` (``drafters.py``), its KV under the same block ids.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import structlog
import torch

from vllm_actors.actors.worker.step_data import BatchInput, GraphSampling
from vllm_actors.envs import envs
from vllm_actors.kernels import kv_quant
from vllm_actors.kernels import sampling as fused_sampling
from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.lora.manager import LoRAManager
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.kv_parallel import KvParallel
from vllm_actors.models.loader import load_model
from vllm_actors.models.parallel import TensorParallel
from vllm_actors.models.pipeline import PipelineStage, run_stage
from vllm_actors.protocol.config import EngineConfig, resolve_scheduler_config
from vllm_actors.runner.deferred_inputs import fill_deferred, fix_overlap
from vllm_actors.runner.devices import free_after_failed_start, resolve_device, resolve_dtype
from vllm_actors.runner.drafters import make_drafter, reattach
from vllm_actors.runner.fp8_staging import (
    attach_fp8_staging,
    flash_attn_outruns_graph,
    fp8_staging_for,
    staged_step,
)
from vllm_actors.runner.graph_draws import GraphDraws
from vllm_actors.runner.graph_inputs import DecodeGraph as _DecodeGraph
from vllm_actors.runner.graph_inputs import GraphInputs
from vllm_actors.runner.host_kv_tier import HostKvTier, num_host_blocks
from vllm_actors.runner.kv_pool_sizing import KvPoolSizing
from vllm_actors.runner.padded_forward import PaddedForward, padded_graphs_enabled
from vllm_actors.runner.settings import graph_sampler_enabled
from vllm_actors.runner.sleep_mode import SleepMode
from vllm_actors.runner.stage_graphs import StageGraphIO
from vllm_actors.runner.staging import Fence
from vllm_actors.runner.step_inputs import StepStaging
from vllm_actors.runner.verify_rows import decode_graph_rows, queries_per_read

log = structlog.get_logger(__name__)

# Decode batch sizes with a captured graph (vLLM's choice): 1, 2, 4, then every 8.
GRAPH_BATCH_SIZES = [1, 2, 4] + list(range(8, 513, 8))


class ModelRunner(GraphDraws, KvPoolSizing):
    supports_deferred_inputs = True  # execute() fills BatchInput.deferred on the device
    supports_overlap_rows = True  # and moves BatchInput.overlap's rows (decode steps, eager or graph)
    padded_graphs = True  # False for a draft model: its catch-ups run eagerly

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None,
                 stage: PipelineStage | None = None, kvp: KvParallel | None = None) -> None:
        """``tp``: this worker's rank of a tensor-parallel group (joined already): it holds that
        rank's shard and KV heads, on GPU ``rank`` (``device`` "auto" or "cuda"). ``stage``: its
        pipeline stage (its layers and their KV only, on GPU ``stage.global_rank``; decode graphs only).
        ``kvp``: its KV-parallel rank (its share of the pool: ``num_blocks`` is every rank's)."""
        self.config = config
        self.tp = tp or TensorParallel()
        self.stage = stage or PipelineStage()
        self.kvp = kvp or KvParallel()
        self._profiling = False  # a profiling pass: the stage runs alone (nothing sent or received)
        index = self.stage.global_rank if self.stage.enabled else self.kvp.global_rank if self.kvp.enabled \
            else self.tp.rank if self.tp.enabled else None
        self.device = resolve_device(config.device, index)
        self.model_config = ModelConfig.from_path(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        # checked before loading: a max_model_len beyond the model's limit fails at once
        limits = resolve_scheduler_config(config, self.model_config.derived_max_model_len, num_blocks=1 << 30,
                                          allow_long_max_model_len=envs.VLLM_ACTORS_ALLOW_LONG_MAX_MODEL_LEN)
        try:
            torch.manual_seed(config.seed)
            self.model, _ = load_model(config.model, self.dtype, self.device, config.load_format, config.seed, self.tp,
                                       self.stage)
            self.kvp.install(self.model, config.block_size)
            self.block_size, self.max_num_tokens = config.block_size, limits.max_num_batched_tokens
            # speculative decoding's draft model or EAGLE-3 head: its weights before the pool, which holds its KV too
            self.drafter = make_drafter(config, self, limits.max_model_len, ModelRunner)
            self.kv_cache_dtype = kv_quant.resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
            # calculated scales come from the first real step (not the profiling pass nor graph warm-ups)
            self._calculate_kv_scales = config.calculate_kv_scales and kv_quant.has_scales(self.kv_cache_dtype)
            self.model.init_kv_scales(self.kv_cache_dtype, calculated=self._calculate_kv_scales)
            self.local_config = self.model.local_config  # this rank's KV heads size the cache
            self.max_num_seqs = config.max_num_seqs
            self.lora = self._lora_manager()  # its device slots before the KV pool takes what is left
            self.fp8_staging = fp8_staging_for(self.model, self.kv_cache_dtype, self.local_config, self.dtype,
                                               self.device, self.max_num_tokens)  # before the pool, as lora
            self.num_blocks = self._choose_num_blocks(limits.max_model_len)
            pool_len = limits.max_model_len if config.kv_borrowing else self.num_blocks * self.block_size  # borrowed KV
            self.max_model_len = min(limits.max_model_len, pool_len)
            self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
            self.kv_caches = self._allocate_kv_cache(self.num_blocks)
            if self.drafter is not None:
                self.drafter.take_pool(self.num_blocks, self.max_model_len, config.enforce_eager)
            # the host tier's blocks, the same on every rank
            self.num_host_blocks = self.stage.min_int(
                self.tp.min_int(num_host_blocks(self.config, self.bytes_per_block), self.device), self.device)
            self.host_tier = HostKvTier(self.kv_caches, self.num_host_blocks) if self.num_host_blocks else None
            self._staging = self._new_staging()
            self._graphs: dict[int, _DecodeGraph] = {}
            self._sampled_graphs: dict[int, _DecodeGraph] = {}  # decode graphs that draw the tokens too
            self._static: GraphInputs | None = None
            self._graph_sizes: list[int] = []
            self._weight_bytes = 0  # the model's, once graphs are captured (verify_rows.py's cost rule)
            self._padded: PaddedForward | None = None
            self._stage_io: StageGraphIO | None = None  # a pipeline stage's hand-over around its graphs
            self.capture_graphs()
            self._sleep = SleepMode(self)
        except BaseException as exc:
            free_after_failed_start(self, exc)
            raise
        log.info(
            "model_runner_ready",
            model=config.model,
            device=str(self.device),
            dtype=str(self.dtype),
            kv_cache_dtype=str(self.kv_cache_dtype),
            num_blocks=self.num_blocks,
            num_host_blocks=self.num_host_blocks,
            block_size=self.block_size,
            cuda_graphs=sorted(self._graphs),
            padded_graphs=sorted(self._padded.graphs) if self._padded else [],
        )

    # ------------------------------------------------------------------ sleep mode
    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleep.asleep)

    def sleep(self, level: int) -> None:
        """Level 1: the weights to host memory, the KV cache freed; level 2: both freed."""
        self._sleep.sleep(level)
        log.info("runner_asleep", level=level)

    def wake_up(self, tags: list[str]) -> None:
        """``tags`` ("weights", "kv_cache") back on the device; graphs captured once both are."""
        self._sleep.wake_up(tags)
        log.info("runner_awake", tags=tags, asleep=sorted(self._sleep.asleep))

    def make_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._allocate_kv_cache(self.num_blocks)

    def reload_model(self) -> None:
        """The weights read from the checkpoint again (a wake after a level-2 sleep)."""
        config = self.config
        torch.manual_seed(config.seed)  # dummy weights: the same draw as at the start
        self.model, _ = load_model(config.model, self.dtype, self.device, config.load_format, config.seed, self.tp,
                                   self.stage)
        self.kvp.install(self.model, config.block_size)
        reattach(self.drafter, self.model)  # an EAGLE-3 head's hook on the new model
        self._calculate_kv_scales = config.calculate_kv_scales and kv_quant.has_scales(self.kv_cache_dtype)
        self.model.init_kv_scales(self.kv_cache_dtype, calculated=self._calculate_kv_scales)
        self.lora = self._lora_manager()  # the new model's hooks; adapters load again on use
        attach_fp8_staging(self.model, self.fp8_staging)

    def _lora_manager(self) -> LoRAManager | None:
        """LoRA's device slots and hooks (``enable_lora``), sized for the largest step's rows."""
        config = self.config
        if not config.enable_lora:
            return None
        rows = self.max_num_tokens + max(self.max_num_seqs, max(GRAPH_BATCH_SIZES))
        return LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, rows,
                           self.device, self.dtype)

    def capture_graphs(self) -> None:
        # KV parallelism on the torch loop (a sliding window) runs eagerly
        if self.device.type == "cuda" and not self.config.enforce_eager and self.kvp.graphs_allowed(self.model):
            self._capture_decode_graphs()

    def drop_graphs(self) -> None:
        self._graphs = {}
        self._sampled_graphs = {}
        self._static = None
        self._graph_sizes = []
        self._padded = None

    def _wants_padded_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and not self.stage.enabled \
            and self.padded_graphs and padded_graphs_enabled()

    def _new_staging(self, fence: Callable[[], Fence] | None = None) -> StepStaging:
        """Two sets of host buffers for a step's integer inputs (pinned on a GPU machine, fenced)."""
        return StepStaging(self.device, self.max_num_tokens, max(self.max_num_seqs, max(GRAPH_BATCH_SIZES)),
                           self.block_size, getattr(self, "max_blocks_per_seq", 1), fence)

    # ------------------------------------------------------------------ inputs
    def _host_inputs(self, batch: BatchInput, rows: int, width: int) -> dict[str, torch.Tensor]:
        """The step's inputs in the next staging set (``StepStaging.fill``; ``enqueued`` once copied)."""
        return self._staging.fill(batch, rows, width)

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def execute(self, batch: BatchInput) -> torch.Tensor:
        """Run one forward pass; return the logits of ``batch.logits_indices`` rows, in the model's
        dtype (a view of a graph's output buffer: read before the next step)."""
        if self.lora is not None:
            self.lora.prepare(batch.loras, batch.query_lens)
        if self._calculate_kv_scales:  # eagerly: the scales are set in place, graphs read them after
            self._calculate_kv_scales = False
            self.model.calculate_kv_scales()
            return self._run_eager(batch)
        if batch.eager:  # a borrowing request's step: its attention calls out to the lenders
            return self._run_eager(batch)
        bucket, rows = self._graph_step(batch)  # a verification step: its decode rows (graph_draws.py)
        if bucket is not None:
            return self._run_graph(rows, bucket)
        larger_decode = batch.is_decode and bool(self._graphs)  # than every decode graph: eager
        if not larger_decode and batch.overlap is None and self._padded is not None and self._padded.graphs \
                and not staged_step(self.model, batch.query_lens):  # a staged fp8 chunk runs eagerly
            size = self._padded.bucket(batch)
            if size is not None and not flash_attn_outruns_graph(self.model, batch.query_lens, batch.seq_lens,
                                                                 self.block_size, self.local_config, size, self.device):
                return self._padded.run(batch, size)
        return self._run_eager(batch)

    def _run_eager(self, batch: BatchInput) -> torch.Tensor:
        device = self.device
        num_seqs = len(batch.query_lens)
        width = max(math.ceil(max(batch.seq_lens) / self.block_size), 1)
        host = self._host_inputs(batch, num_seqs, width)
        on_device = {name: tensor.to(device, non_blocking=True) for name, tensor in host.items()}
        self._staging.enqueued()
        fill_deferred(on_device["input_ids"], batch, on_device.get("deferred"))
        seq_lens_cpu = list(batch.seq_lens)  # upper bounds where rows follow a pending verification
        if batch.overlap is not None:
            fix_overlap(on_device, batch, self.block_size)
            if device.type != "cuda":  # the torch reference reads the host's lengths; no GPU waits here
                seq_lens_cpu = on_device["seq_lens"].tolist()
        meta = AttentionMetadata(
            slot_mapping=on_device["slot_mapping"],
            query_start_loc=on_device["query_start_loc"],
            seq_lens=on_device["seq_lens"],
            block_tables=on_device["block_tables"],
            max_query_len=max(batch.query_lens),
            max_seq_len=max(batch.seq_lens),
            query_lens_cpu=list(batch.query_lens),
            seq_lens_cpu=seq_lens_cpu,
        )
        def forward(intermediate: torch.Tensor | None) -> torch.Tensor:
            return self.model(on_device["input_ids"], on_device["positions"], meta, self.kv_caches, intermediate)

        hidden = run_stage(self.stage, forward, len(batch.token_ids), self.local_config.hidden_size, self.dtype,
                           device, communicate=not self._profiling)
        if hidden is None:  # a stage before the last: its output went on to the next stage
            return torch.empty((0, 0), dtype=self.dtype, device=device)
        return self.model.compute_logits(hidden.index_select(0, on_device["logits_indices"]))

    def _capture_decode_graphs(self) -> None:
        started = time.perf_counter()
        largest = min(max(GRAPH_BATCH_SIZES), decode_graph_rows(self.max_num_seqs, self.max_num_tokens,
                                                               self.config.speculative_config))
        edges = {largest, min(largest, self.max_num_seqs)}  # and the largest plain decode step's (it samples)
        sizes = sorted({size for size in GRAPH_BATCH_SIZES if size <= largest} | edges)
        device = self.device
        self._weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        reads = queries_per_read(bool(self.config.speculative_config), self.model, self.local_config, self.block_size)
        self._static = GraphInputs(largest, self.max_blocks_per_seq, self.block_size, device, queries_per_read=reads)
        # only the last stage samples (stage_graphs.py)
        self._stage_io = StageGraphIO(self.stage, largest, self.local_config.hidden_size, self.dtype, device) \
            if self.stage.enabled else None
        sample_in_graph = graph_sampler_enabled() and fused_sampling.HAVE_TRITON and self.stage.is_last
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        if self._wants_padded_graphs():  # first: their largest step sizes the shared pool
            self._padded = PaddedForward(self, self.max_num_tokens, self.max_num_seqs)
            self._padded.capture(pool, stream)
        with torch.inference_mode():
            for size in sorted(sizes, reverse=True):  # largest first: the pool grows once
                inputs = self._static.for_bucket(size)
                inputs = self._stage_io.bucket_inputs(inputs, size) if self._stage_io is not None else inputs
                meta = self._static.meta(inputs, size, self.max_model_len)
                for sampled in (False, True) if sample_in_graph and size <= self.max_num_seqs else (False,):
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # warm up (Triton autotuning, lazy init) outside the graph
                            self._decode_pass(inputs, meta, sampled)
                    torch.cuda.current_stream(device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        output = self._decode_pass(inputs, meta, sampled)
                    (self._sampled_graphs if sampled else self._graphs)[size] = _DecodeGraph(graph, output)
        self._graph_sizes = sorted(self._graphs)
        torch.cuda.synchronize(device)
        log.info("cuda_graphs_captured", sizes=len(sizes), seconds=round(time.perf_counter() - started, 2))

    def _decode_pass(self, inputs: dict[str, torch.Tensor], meta: AttentionMetadata, sampled: bool) -> torch.Tensor:
        hidden = self.model(inputs["input_ids"], inputs["positions"], meta, self.kv_caches, inputs.get("intermediate"))
        if not self.stage.is_last:
            return hidden  # [2, size, hidden]: sent on after the replay
        logits = self.model.compute_logits(hidden)
        if not sampled:
            return logits
        return fused_sampling.gumbel_argmax(logits, inputs["inv_temperature"], inputs["noise"], inputs["seeds"])

    def _run_graph(self, batch: BatchInput, bucket: int, sampling: GraphSampling | None = None) -> torch.Tensor:
        assert self._static is not None
        pairs = self._static.upload(batch, bucket, sampling)
        fill_deferred(self._static.device["input_ids"], batch, pairs)
        if batch.overlap is not None:  # rows after a pending verification (the graph reads lengths on the device)
            fix_overlap(self._static.device, batch, self.block_size)
        graph = (self._sampled_graphs if sampling is not None else self._graphs)[bucket]
        if self._stage_io is not None:  # a pipeline stage: its input received before the replay, its output sent after
            return self._stage_io.replay(graph.graph, graph.logits, bucket, len(batch.query_lens))
        graph.graph.replay()
        return graph.logits[: len(batch.query_lens)]
