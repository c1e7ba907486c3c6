"""xgrammar vs llguidance on this CPU, with the embedded default model's tokenizer
(SmolLM2-135M GGUF, 49,152 tokens) and, optionally, a tiny HF checkpoint's tokenizer.

Per library: tokenizer set-up, compile time of a few JSON schemas, a regex, a choice and an EBNF
grammar (first compile, cold), per-token mask fill along a random walk through the grammar (a random
allowed token each step, same seed for both), and the process's resident memory after each phase.
xgrammar is not a project dependency: install it aside (``pip install --no-deps --target DIR
xgrammar==0.2.8 apache-tvm-ffi``) and pass ``--xgrammar-path DIR``.

    .venv/bin/python benchmarks/grammar_libraries.py --xgrammar-path /tmp/gl/xg
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SCHEMAS: dict[str, dict[str, Any]] = {
    "small": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]},
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "owner": {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                       "role": {"enum": ["admin", "user", "guest"]}},
                      "required": ["email", "role"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["id", "tags", "owner"],
    },
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"]}}, "required": ["name", "arguments"]},
}
REGEX = r"(\d{3}-\d{3}-\d{4})|([A-Z][a-z]+ [A-Z][a-z]+)"
CHOICE = ["positive", "negative", "neutral", "mixed feelings"]
EBNF = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= num | "(" expr ")"\nnum ::= [0-9]+'


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - start) * 1e3


def allowed_ids(mask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


class LLGuidance:
    name = "llguidance"

    def __init__(self, backend_json: str, vocab: int, eos: int) -> None:
        import llguidance
        self.ll = llguidance
        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(backend_json, n_vocab=vocab, eos_token=eos)
        self.eos = eos

    def compile(self, kind: str, spec: Any) -> Any:
        ll = self.ll
        if kind == "json":
            grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = ll.grammar_from("regex", spec)
        elif kind == "choice":
            grammar = ll.grammar_from("choice", json.dumps(spec))
        else:
            grammar = ll.grammar_from("grammar", spec)
        matcher = ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def walk(self, matcher: Any, steps: int, rng: random.Random) -> list[float]:
        mask = np.zeros((self.vocab + 31) // 32, dtype=np.int32)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            times.append((time.perf_counter() - start) * 1e6)
            ids = allowed_ids(mask, self.vocab)
            token = int(rng.choice(list(ids)))
            if token == self.eos or not matcher.consume_token(token) or matcher.is_stopped():
                matcher.reset()
        return times


class XGrammar:
    name = "xgrammar"

    def __init__(self, backend_json: str, vocab: int, eos: int) -> None:
        import torch
        import xgrammar
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgrammar
        self.torch = torch
        self.vocab = vocab
        self.eos = eos
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        if kind == "json":
            compiled = c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        elif kind == "regex":
            compiled = c.compile_regex(spec)
        elif kind == "choice":
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in spec))
        else:
            compiled = c.compile_grammar(spec)
        return self.xgr.GrammarMatcher(compiled)

    def walk(self, matcher: Any, steps: int, rng: random.Random) -> list[float]:
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append((time.perf_counter() - start) * 1e6)
            ids = allowed_ids(bitmask[0].numpy(), self.vocab)
            token = int(rng.choice(list(ids)))
            if token == self.eos or not matcher.accept_token(token) or matcher.is_terminated():
                matcher.reset()
        return times


def measure(lib_cls: type, backend_json: str, vocab: int, eos: int, steps: int) -> dict[str, Any]:
    import torch  # noqa: F401  (the worker has torch and transformers loaded: keep imports out of the figures)
    import transformers  # noqa: F401
    if lib_cls is XGrammar:
        import xgrammar  # noqa: F401
    else:
        import llguidance  # noqa: F401
    gc.collect()
    base = rss_mib()
    lib, setup_ms = timed(lambda: lib_cls(backend_json, vocab, eos))
    after_setup = rss_mib()
    specs: list[tuple[str, str, Any]] = [(f"json:{k}", "json", v) for k, v in SCHEMAS.items()]
    specs += [("regex", "regex", REGEX), ("choice", "choice", CHOICE), ("ebnf", "grammar", EBNF)]
    compile_ms: dict[str, float] = {}
    fill_us: dict[str, tuple[float, float]] = {}
    for label, kind, spec in specs:
        matcher, ms = timed(lambda kind=kind, spec=spec: lib.compile(kind, spec))
        compile_ms[label] = round(ms, 2)
        times = lib.walk(matcher, steps, random.Random(0))
        fill_us[label] = (round(statistics.median(times), 1), round(statistics.mean(times), 1), round(max(times), 1))
    return {
        "library": lib.name, "tokenizer_setup_ms": round(setup_ms, 1), "compile_ms": compile_ms,
        "mask_fill_us_median_mean_max": fill_us, "rss_setup_mib": round(after_setup - base, 1),
        "rss_total_mib": round(rss_mib() - base, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--xgrammar-path", help="a folder xgrammar 0.2.8 is installed into (--target)")
    parser.add_argument("--library", choices=["llguidance", "xgrammar"], action="append")
    parser.add_argument("--tokenizer", default="default", help="'default' (the GGUF model) or an HF folder")
    parser.add_argument("--steps", type=int, default=300, help="mask fills per grammar")
    args = parser.parse_args()
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    from vllm_actors.actors.frontend.tokenizer import Tokenizer
    from vllm_actors.default_model import default_model_path
    tok = Tokenizer.from_path(default_model_path() if args.tokenizer == "default" else args.tokenizer)
    backend_json = tok.backend.to_str()
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    libs = {"llguidance": LLGuidance, "xgrammar": XGrammar}
    for name in args.library or ["llguidance", "xgrammar"]:
        print(json.dumps(measure(libs[name], backend_json, tok.vocab_size, eos, args.steps)), flush=True)


if __name__ == "__main__":
    main()
