"""Errors of the frontend's text work, raised by the tokenizer and caught by ``text.py``."""

from __future__ import annotations


class TooManyTokens(ValueError):
    """``Tokenizer.encode`` found more tokens than its limit."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(f"{count} tokens, more than {limit}")
        self.count = count
        self.limit = limit
