"""The grammars' view of the model's vocabulary: llguidance's tokenizer built from the model's
tokenizer (the frontend's loader), and the worker's ``Grammars`` over it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_actors.runner.grammar import Grammars

if TYPE_CHECKING:
    import llguidance


def llguidance_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for the model's (a Hugging Face folder's tokenizer.json, or the one the
    frontend builds from a GGUF file's metadata), over the logits' width."""
    import llguidance

    from vllm_actors.actors.frontend.tokenizer import load_tokenizer

    backend = load_tokenizer(tokenizer_path).backend
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))


def worker_grammars(tokenizer_path: str, vocab_size: int, eos_token_ids: Sequence[int]) -> Grammars:
    """The worker's ``Grammars`` over the model's tokenizer (loaded at the first constrained request)."""
    eos = list(eos_token_ids)
    return Grammars(lambda: llguidance_tokenizer(tokenizer_path, vocab_size, eos))
