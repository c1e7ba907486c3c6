"""Speculative decoding (n-gram, draft model, EAGLE-3) on a prompt-copying workload: batch-1 ms/token and
output tok/s at several concurrencies, without and with speculation, on this engine and optionally
on vLLM (``--peer vllm``, its packages under ``--vllm-pythonpath``) on the same checkpoint and prompts.

    python benchmarks/spec_decode.py --convert-default /tmp/smollm2-hf     # the embedded GGUF as HF
    python benchmarks/spec_decode.py --model /tmp/smollm2-hf --out /tmp/spec [--peer vllm]

``--draft-layers N`` adds the mode ``draft``: a draft model of the target's shape with N layers and
random weights (``--out``/draft-N; its drafts are rejected, so the adaptive drafts per step should
fall to 0 and its rates come close to ``off``); ``--always-draft`` drafts ``--num-speculative-tokens``
every step instead (as vLLM does: the draft path's step cost is what it measures). Under ``--model-shape``,
``--dummy-weights echo`` gives the target and the draft echo weights (below), so every draft is right, as
vLLM's dummy draft agrees with its dummy target: both engines' draft paths at full acceptance.
Our modes' engines start side by side on the GPU (``--gpu-memory-utilization`` split between them) and
are measured in ``--rounds`` paired rounds: each phase (batch 1, each concurrency) on every mode in turn,
the order reversed every other round, so that a neighbour's load or the clock state falls on every mode
alike; per mode the medians over rounds, each round's figures (``rounds``) and, against ``off``, the
per-round ratios (``paired_vs_off``: median, min, max; ``lib/spec_paired.py``). ``--unpaired``: one
engine after another, each alone (a model too large to hold once per mode). vLLM runs after ours, one
process per mode, unpaired. ``--queued 8 16``: also N requests at once with a queue behind them (engines
started with ``max_num_seqs`` N, 4 x N requests a call: ``vllm bench serve --max-concurrency N``'s
measure, where a closed batch's length is its slowest request's; ``lib/spec_queued.py``), paired too; vLLM
one process per mode and N.
``--model-shape qwen3-8b`` runs a model shape with dummy weights instead of ``--model`` (prompts
of random token ids: no tokenizer). The mode ``eagle3`` drafts with a random EAGLE-3 head of the
target's shape (``--out``/eagle3-head, random bfloat16 weights both engines load; ours draws its own
under ``--model-shape``): its drafts are rejected, so with ``--always-draft`` it measures the head's
step cost against vLLM's ``eagle3`` on the same head.
The mode ``oracle`` (with ``off``; ours only, batch 1) replays the off run's greedy outputs as drafts,
each right with the probability of each ``--oracle-acceptance``: the verification cost at a known
acceptance (``lib/spec_oracle.py``; also ``OUT/oracle.md``). Under ``--model-shape`` every engine of
ours then loads the echo dummy weights (``--dummy-weights``, ``VLLM_ACTORS_DUMMY_WEIGHTS=echo``:
residual projections scaled down, LM head equal to the embedding), whose greedy output repeats the
last prompt token by a wide logit margin, so verification steps of any shape keep the off run's
output, at the cost per step of random weights of the same shape.

    python benchmarks/spec_decode.py --model-shape qwen3-8b --modes off oracle --oracle-acceptance 0.3 0.6 0.9 \
        --concurrency --out /tmp/oracle

Both engines' speculation counters per phase (``phase_drafting``; vLLM's from ``LLM.get_metrics()``,
``--no-vllm-stats`` turns its stats logging off and them with it) give per mode and engine
``step_cost`` (``lib/spec_counters.py``): per phase the tokens per request-step, vLLM's mean
acceptance length and the acceptance rate, at batch 1 the ms per step (ms/token x tokens per step):
the engines compared per verification step whatever their drafts' acceptance.

Writes ``results.json`` in ``--out`` and prints one line per engine and mode, and a step-cost line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# The repository instead of this folder (whose kernels.py would shadow the package transformers imports).
sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.lib import spec_counters, spec_measure, spec_oracle, spec_ours, spec_paired  # noqa: E402
from vllm_actors.bench.throughput_workload import MODEL_SHAPES, write_model_dir  # noqa: E402


def convert_default(target: str) -> None:
    """The embedded SmolLM2-135M-Instruct GGUF saved as a Hugging Face checkpoint (bfloat16), so that
    both engines load the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_actors.default_model import default_model_path

    path = default_model_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # transformers marks a GGUF load quantized: not saveable as such
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.bfloat16).save_pretrained(target)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(target)


def prompts(model: str, count: int, words: int, tokenizer: bool = True) -> list[list[int]]:
    if not tokenizer:  # a shape without a tokenizer: random ids of about a passage's length
        rng = random.Random(0)
        return [[rng.randrange(1000, 30000) for _ in range(2 * words)] for _ in range(count)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.apply_chat_template(spec_measure.copy_messages(passage), add_generation_prompt=True,
                                           tokenize=False) for passage in spec_measure.passages(count, words)]
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]


def write_draft(target: str, layers: int, folder: Path, load_format: str) -> Path:
    """A draft model of ``target``'s shape with ``layers`` layers: its config (and, unless the run
    uses dummy weights, random bfloat16 weights and the target's tokenizer files)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(target) / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], layers)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt"):
        if (Path(target) / name).is_file():
            shutil.copy(Path(target) / name, folder / name)
    if load_format != "dummy":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
        model.save_pretrained(folder)
    return folder


def write_eagle3_head(target: str, folder: Path) -> Path:
    """A random EAGLE-3 head of ``target``'s shape (vLLM's ``LlamaForCausalLMEagle3``): one layer, ``fc``
    over three hidden states, a draft vocabulary of the first min(32000, vocab) ids (``d2t`` zeros)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    t = json.loads((Path(target) / "config.json").read_text())
    hidden, heads, inter = t["hidden_size"], t["num_attention_heads"], t["intermediate_size"]
    kv_heads, dim = t.get("num_key_value_heads") or heads, t.get("head_dim") or hidden // heads
    draft_vocab = min(32000, t["vocab_size"])
    keep = ("vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings")
    config = {key: t[key] for key in keep if key in t} | {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": dim, "intermediate_size": inter,
        "num_hidden_layers": 1, "draft_vocab_size": draft_vocab, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {"fc.weight": (hidden, 3 * hidden), "midlayer.self_attn.q_proj.weight": (heads * dim, 2 * hidden),
              "midlayer.self_attn.k_proj.weight": (kv_heads * dim, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (kv_heads * dim, 2 * hidden),
              "midlayer.self_attn.o_proj.weight": (hidden, heads * dim),
              "midlayer.mlp.gate_proj.weight": (inter, hidden),
              "midlayer.mlp.up_proj.weight": (inter, hidden), "midlayer.mlp.down_proj.weight": (hidden, inter),
              "lm_head.weight": (draft_vocab, hidden)}
    tensors = {name: torch.randn(shape, dtype=torch.bfloat16) * 0.02 for name, shape in shapes.items()}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def run_peer(args: argparse.Namespace, spec_path: Path, mode: str, max_num_seqs: int | None = None) -> dict[str, Any]:
    """vLLM in ``mode`` (``peer_spec.py`` under its environment); with ``max_num_seqs``, its queued phase only."""
    script = Path(__file__).resolve().parent / "lib" / "peer_spec.py"
    name = f"vllm_{mode}" + (f"_queued_{max_num_seqs}" if max_num_seqs else "")
    out = Path(args.out) / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=args.vllm_pythonpath)
    queued = ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
    completed = subprocess.run([args.vllm_python, str(script), "--model", args.model, "--prompts", str(spec_path),
                                "--mode", mode, "--out", str(out), *queued], env=env, check=False, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (Path(args.out) / f"{name}.log").write_text(completed.stdout)
    if completed.returncode != 0 or not out.is_file():
        return {"error": " | ".join(completed.stdout.splitlines()[-8:])}
    return dict(json.loads(out.read_text()))


def run_oracles(args: argparse.Namespace, spec: dict[str, Any], results: dict[str, Any],
                recorded: list[list[int]]) -> None:
    """The oracle at each set acceptance (one engine each) into ``results``, and ``OUT/oracle.md``."""
    off_ms = results["ours_off"]["batch1_ms_per_token"]
    oracles: dict[str, dict[str, Any]] = {}
    for acceptance in args.oracle_acceptance:
        try:
            found = spec_oracle.run_oracle(args.model, spec, acceptance, recorded, args.num_speculative_tokens,
                                           args.oracle_passes, off_ms)
        except Exception as error:  # noqa: BLE001  # one acceptance failing leaves the others' figures
            found = {"acceptance": acceptance, "error": f"{type(error).__name__}: {error}"}
        oracles[f"ours_oracle_{acceptance}"] = found
        print(f"ours oracle {acceptance}: {json.dumps({k: v for k, v in found.items() if 'samples' not in k})}",
              flush=True)
    results.update(oracles)
    report = spec_oracle.markdown(off_ms, oracles, args.num_speculative_tokens)
    (Path(args.out) / "oracle.md").write_text(report)
    print(report, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--convert-default", metavar="DIR", help="save the embedded GGUF as an HF checkpoint; exit")
    parser.add_argument("--model", help="a Hugging Face checkpoint directory")
    parser.add_argument("--out", default="spec-decode-results")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--passage-words", type=int, default=150)
    parser.add_argument("--output-len", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 16, 64, 256])
    parser.add_argument("--batch-repeats", type=int, default=1,
                        help="each closed batch run this many times in a row per round (tok/s over them all)")
    parser.add_argument("--queued", type=int, nargs="*", default=[],
                        help="N requests at once with a queue behind them (engines of max_num_seqs N, "
                             f"{spec_measure.QUEUED_PER_SLOT} x N requests a call: vLLM's --max-concurrency)")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                        help="a model shape with dummy weights instead of --model (no tokenizer)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="add the mode 'draft': a random draft of the target's shape with this many layers")
    parser.add_argument("--modes", nargs="*", choices=["off", "ngram", "ngram-overlap", "draft", "eagle3", "oracle"],
                        default=None, help="default: off and ngram, and draft with --draft-layers (oracle: with off, "
                        "ours only; ngram-overlap: ngram with VLLM_ACTORS_SPEC_OVERLAP=1, ours only)")
    parser.add_argument("--oracle-acceptance", type=float, nargs="+", default=[0.3, 0.6, 0.9],
                        help="the oracle's set acceptances, one engine each")
    parser.add_argument("--oracle-passes", type=int, default=6,
                        help="at most this many runs of a prompt until its output is the continuation drafted")
    parser.add_argument("--dummy-weights", choices=["echo", "random"], default=None,
                        help="under --model-shape: our engines' dummy weights (echo: greedy output robust to rounding, "
                             "a draft model's drafts all right; VLLM_ACTORS_DUMMY_WEIGHTS); default echo with the mode "
                             "'oracle', else random")
    parser.add_argument("--rounds", type=int, default=3,
                        help="paired rounds: every phase on every mode of ours in turn, the order reversed each round")
    parser.add_argument("--dump-events", metavar="DIR", default=None,
                        help="our engines' event logs saved in DIR at the end (MODE.jsonl; raise "
                             "VLLM_ACTORS_METRICS_MAX_EVENTS to keep a whole run)")
    parser.add_argument("--unpaired", action="store_true",
                        help="our modes' engines one after another, each alone on the GPU (default: side by side)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="the GPU share of our engines together (split between the paired engines)")
    parser.add_argument("--always-draft", action="store_true",
                        help="draft --num-speculative-tokens every step (no adaptive drafts per step)")
    parser.add_argument("--peer", choices=["vllm"], default=None)
    parser.add_argument("--vllm-python", default=sys.executable)
    parser.add_argument("--vllm-pythonpath", default="/tmp/vsite")
    parser.add_argument("--vllm-stats", action=argparse.BooleanOptionalAction, default=True,
                        help="vLLM's stats logging, which its speculation counters per phase need (--no-vllm-stats: "
                             "off, to see what it costs)")
    args = parser.parse_args(argv)
    if args.convert_default:
        convert_default(args.convert_default)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.model_shape:
        args.model = str(write_model_dir(Path(args.out) / args.model_shape, MODEL_SHAPES[args.model_shape]))
    if not args.model:
        parser.error("--model or --model-shape is required (make a model with --convert-default DIR)")
    modes = args.modes or ["off", "ngram"] + (["draft"] if args.draft_layers else [])
    if "draft" in modes and not args.draft_layers:
        parser.error("the mode 'draft' needs --draft-layers N")
    if "oracle" in modes and "off" not in modes:
        parser.error("the mode 'oracle' needs the mode 'off' (its greedy outputs are the oracle's continuations)")
    if any(slots < 1 for slots in args.queued):
        parser.error("--queued values must be at least 1")
    if any(not 0.0 <= a <= 1.0 for a in args.oracle_acceptance):
        parser.error("--oracle-acceptance values must be from 0 to 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.batch_repeats < 1:
        parser.error("--batch-repeats must be at least 1")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    load_format = "dummy" if args.model_shape else "auto"
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
             "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    configs: dict[str, Any] = {"ngram": ngram, "ngram-overlap": ngram}
    if args.draft_layers:
        draft = write_draft(args.model, args.draft_layers, Path(args.out) / f"draft-{args.draft_layers}", load_format)
        configs["draft"] = {"method": "draft_model", "model": str(draft),
                            "num_speculative_tokens": args.num_speculative_tokens}
    if "eagle3" in modes:
        head = write_eagle3_head(args.model, Path(args.out) / "eagle3-head")
        configs["eagle3"] = {"method": "eagle3", "model": str(head),
                             "num_speculative_tokens": args.num_speculative_tokens}
    count = max(args.repeats, max(args.concurrency, default=1))
    spec: dict[str, Any] = {
        "prompts": prompts(args.model, count, args.passage_words, tokenizer=not args.model_shape),
        "output_len": args.output_len, "repeats": args.repeats, "concurrency": args.concurrency,
        "batch_repeats": args.batch_repeats,
        "max_model_len": 2048, "load_format": load_format, "tokenizer": not args.model_shape,
        "speculative_config": ngram, "speculative_configs": configs, "always_draft": args.always_draft,
        "vllm_stats": args.vllm_stats, "queued": args.queued, "queued_rounds": args.rounds,
    }
    spec_path = Path(args.out) / "workload.json"
    spec_path.write_text(json.dumps(spec))
    dummy_weights = (args.dummy_weights or ("echo" if "oracle" in modes else "random")) \
        if load_format == "dummy" else "random"
    os.environ["VLLM_ACTORS_DUMMY_WEIGHTS"] = dummy_weights  # ours only (engine processes inherit it)
    results: dict[str, Any] = {"settings": {k: v for k, v in spec.items() if k != "prompts"} | {
        "rounds": args.rounds, "paired": not args.unpaired, "gpu_memory_utilization": args.gpu_memory_utilization,
        "dummy_weights": dummy_weights if load_format == "dummy" else None}}
    ours = [mode for mode in modes if mode != "oracle"]
    found, recorded = spec_ours.run_ours(args.model, spec, ours, args.rounds, args.gpu_memory_utilization,
                                         paired=not args.unpaired, record="oracle" in modes,
                                         events_dir=Path(args.dump_events) if args.dump_events else None)
    for mode in ours:
        results[f"ours_{mode}"] = found[mode]
        shown = {k: v for k, v in found[mode].items() if "samples" not in k and not k.startswith("paired_vs")}
        print(f"ours {mode}: {json.dumps(shown)}", flush=True)
    for mode in ours:
        if "paired_vs_off" in found[mode]:
            print(spec_paired.paired_line(mode, "off", found[mode]["paired_vs_off"]), flush=True)
    if "oracle" in modes:  # the oracle replays the off run's outputs
        run_oracles(args, spec, results, recorded)
    for mode in [mode for mode in ours if mode != "ngram-overlap"] if args.peer else []:  # vLLM after ours
        results[f"vllm_{mode}"] = run_peer(args, spec_path, mode)
        for slots in args.queued:  # one engine of max_num_seqs N each
            found = run_peer(args, spec_path, mode, max_num_seqs=slots)
            results[f"vllm_{mode}"][f"queued_{slots}_tok_s"] = found.get(f"queued_{slots}_tok_s", found.get("error"))
        print(f"vllm {mode}: {json.dumps(results[f'vllm_{mode}'])}", flush=True)
    for mode in ours:  # per verification step, whatever each engine's acceptance
        costs = {engine: spec_counters.step_cost(results[f"{engine}_{mode}"])
                 for engine in ("ours", "vllm") if f"{engine}_{mode}" in results}
        for engine, cost in costs.items():
            if cost:
                results[f"{engine}_{mode}"]["step_cost"] = cost
        print(spec_counters.step_line(mode, costs), flush=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
