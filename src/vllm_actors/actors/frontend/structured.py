"""The frontend's check of a structured-output constraint (``SamplingParams.structured_outputs``):
the spec is turned into llguidance's grammar and validated before anything is queued, so a bad
JSON schema, regex or grammar is a ``ValueError`` naming the field (a 400 in the server) rather
than a request the worker cannot constrain. Results are cached per (kind, spec), as the worker's
compiled grammars are."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from vllm_actors.actors.frontend.regex_classes import ascii_classes, ascii_schema_text
from vllm_actors.protocol.sampling import StructuredOutputs

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar longer than 1 MiB is refused
CHECKED_SPECS = 1024  # verdicts kept (oldest dropped first), keyed by digest
_ERRORS: dict[tuple[str, bytes], str] = {}


def check_structured_outputs(spec: StructuredOutputs | None, has_tokenizer: bool) -> None:
    if spec is None:
        return
    if not has_tokenizer:
        raise ValueError("structured_outputs: constrained decoding needs a tokenizer (skip_tokenizer_init=True)")
    kind = spec.kind
    text = json.dumps(spec.choice) if spec.choice is not None else str(getattr(spec, kind))
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{kind}: longer than {MAX_SPEC_CHARS} characters")
    key = cache_key(spec)
    error = _ERRORS.get(key)
    if error is None:
        error = _ERRORS[key] = _grammar_error(kind, text)
        while len(_ERRORS) > CHECKED_SPECS:
            try:
                _ERRORS.pop(next(iter(_ERRORS)), None)
            except (RuntimeError, StopIteration):  # another thread changed it meanwhile: done next time
                break
    if error:
        raise ValueError(f"structured_outputs.{kind}: {error}"[:1000])


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for a constraint (raises ValueError on JSON that does not parse).
    JSON is compact (no free whitespace between tokens, vLLM's ``disable_any_whitespace``): a small
    model sampled at temperature 1 otherwise wanders into runs of spaces and newlines. Regexes (and
    schemas' patterns) read ``\\d \\w \\s`` as ASCII classes, as vLLM's default backend does."""
    import llguidance

    options: dict[str, Any] = {"whitespace_flexible": False}
    if spec.json is not None:
        json.loads(spec.json)
        schema = ascii_schema_text(spec.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)  # type: ignore[arg-type]
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(spec.regex))
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


def cache_key(spec: StructuredOutputs) -> tuple[str, bytes]:
    """(kind, a digest of the spec): a cache of many large schemas holds 32 bytes for each."""
    text = json.dumps(spec.choice) if spec.choice is not None else str(getattr(spec, spec.kind))
    return spec.kind, hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32).digest()


def _grammar_error(kind: str, text: str) -> str:
    """llguidance's complaint about the spec ('' when it is valid)."""
    import llguidance

    fields: dict[str, Any] = {kind: json.loads(text) if kind == "choice" else True if kind == "json_object" else text}
    spec = StructuredOutputs(**fields)
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as error:
            return f"not valid JSON: {error}"
        if not isinstance(schema, (dict, bool)):
            return "a JSON schema must be an object or a boolean"
    try:
        grammar = grammar_text(spec)
    except (ValueError, TypeError) as error:
        return str(error)
    return llguidance.LLMatcher.validate_grammar(grammar).strip()
