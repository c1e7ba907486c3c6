"""Speculative decoding (n-gram) on a prompt-copying workload: batch-1 ms/token and output tok/s at
several concurrencies, without and with speculation, on this engine and optionally on vLLM
(``--peer vllm``, its packages under ``--vllm-pythonpath``) on the same checkpoint and prompts.

    python benchmarks/spec_decode.py --convert-default /tmp/smollm2-hf     # the embedded GGUF as HF
    python benchmarks/spec_decode.py --model /tmp/smollm2-hf --out /tmp/spec [--peer vllm]

Writes ``results.json`` in ``--out`` and prints one line per engine and mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# The repository instead of this folder (whose kernels.py would shadow the package transformers imports).
sys.path[0] = str(Path(__file__).resolve().parents[1])
from benchmarks.lib import spec_measure  # noqa: E402


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


def prompts(model: str, count: int, words: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.apply_chat_template(spec_measure.copy_messages(passage), add_generation_prompt=True,
                                           tokenize=False) for passage in spec_measure.passages(count, words)]
    return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]


def run_ours(args: argparse.Namespace, spec: dict[str, Any], speculative: bool) -> dict[str, Any]:
    from vllm_actors import LLM, SamplingParams

    with LLM(args.model, dtype="auto", max_model_len=spec["max_model_len"], enable_prefix_caching=False,
             speculative_config=spec["speculative_config"] if speculative else None) as llm:
        def generate(batch: Any, max_tokens: int) -> tuple[int, float]:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
            inputs = [{"prompt_token_ids": list(p)} for p in batch]
            return spec_measure.timed(lambda: sum(len(o.outputs[0].token_ids)
                                                  for o in llm.generate(inputs, params, use_tqdm=False)))

        result = spec_measure.measure(generate, spec["prompts"], spec["output_len"], spec["repeats"],
                                      spec["concurrency"])
        result["spec_decode"] = _counts(llm)
    return result


def _counts(llm: Any) -> dict[str, Any]:
    spec = llm.get_metrics().spec_decode
    return {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens, "accepted_per_pos": list(spec.accepted_per_pos)}


def run_peer(args: argparse.Namespace, spec_path: Path, mode: str) -> dict[str, Any]:
    script = Path(__file__).resolve().parent / "lib" / "peer_spec.py"
    out = Path(args.out) / f"vllm_{mode}.json"
    env = dict(os.environ, PYTHONPATH=args.vllm_pythonpath)
    completed = subprocess.run([args.vllm_python, str(script), "--model", args.model, "--prompts", str(spec_path),
                                "--mode", mode, "--out", str(out)], env=env, check=False, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    (Path(args.out) / f"vllm_{mode}.log").write_text(completed.stdout)
    if completed.returncode != 0 or not out.is_file():
        return {"error": " | ".join(completed.stdout.splitlines()[-8:])}
    return dict(json.loads(out.read_text()))


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
    parser.add_argument("--peer", choices=["vllm"], default=None)
    parser.add_argument("--vllm-python", default=sys.executable)
    parser.add_argument("--vllm-pythonpath", default="/tmp/vsite")
    args = parser.parse_args(argv)
    if args.convert_default:
        convert_default(args.convert_default)
        return 0
    if not args.model:
        parser.error("--model is required (make one with --convert-default DIR)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    spec: dict[str, Any] = {
        "prompts": prompts(args.model, max(args.repeats, max(args.concurrency, default=1)), args.passage_words),
        "output_len": args.output_len, "repeats": args.repeats, "concurrency": args.concurrency,
        "max_model_len": 2048,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                               "prompt_lookup_max": args.prompt_lookup_max,
                               "prompt_lookup_min": args.prompt_lookup_min},
    }
    spec_path = Path(args.out) / "workload.json"
    spec_path.write_text(json.dumps(spec))
    results: dict[str, Any] = {"settings": {k: v for k, v in spec.items() if k != "prompts"}}
    for mode in ("off", "ngram"):
        results[f"ours_{mode}"] = run_ours(args, spec, mode == "ngram")
        print(f"ours {mode}: {json.dumps({k: v for k, v in results[f'ours_{mode}'].items() if 'samples' not in k})}",
              flush=True)
        if args.peer:
            results[f"vllm_{mode}"] = run_peer(args, spec_path, mode)
            print(f"vllm {mode}: {json.dumps(results[f'vllm_{mode}'])}", flush=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
