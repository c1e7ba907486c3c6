"""The settings' parsers: each takes the stripped text and returns the value, or raises
``ValueError("must be ...")`` (``Setting.read`` adds the variable's name and the text)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal, cast

KernelChoice = Literal["auto", "torch", "triton"]


def parse_bool(text: str) -> bool:
    value = text.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 0 or 1 (or true/false, yes/no, on/off)")


def integer(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"must be a whole number >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"must be a whole number >= {minimum}")
        return value

    return parse


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number") from None


def positive_number(text: str) -> float:
    value = number(text)
    if not value > 0:
        raise ValueError("must be a number > 0")
    return value


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def fused_quant_mode(text: str) -> str:
    """``VLLM_ACTORS_FP8_FUSED_QUANT``: ``off``, ``eager`` (a true switch) or ``graphs``."""
    if text.lower() == "graphs":
        return "graphs"
    try:
        return "eager" if parse_bool(text) else "off"
    except ValueError:
        raise ValueError("must be 0, 1 or graphs") from None


def kernel_choice(text: str) -> KernelChoice:
    return cast(KernelChoice, choice("torch", "triton", "auto")(text))


LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")  # logging's names


def log_level(text: str) -> str:
    name = text.upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"must be a logging level ({', '.join(LOG_LEVELS)})")
    return name


def profile_window(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"([0-9]+):([0-9]+)", text)
    if match is None or int(match.group(2)) < 1:
        raise ValueError("must be FIRST:COUNT with COUNT >= 1 (e.g. 200:8)")
    return int(match.group(1)), int(match.group(2))


def text(value: str) -> str:
    return value
