"""Regex class escapes read as vLLM's default grammar backend (xgrammar) reads them: ASCII only.

llguidance's regexes are Unicode-aware (``\\d`` matches a digit of any script, "꯹" or "߇");
``ascii_classes`` spells ``\\d \\D \\w \\W \\s \\S`` out as xgrammar's explicit classes before a
regex, or a JSON schema's ``pattern`` / ``patternProperties``, reaches llguidance. Inside a class
the replacement nests (``[a\\d]`` becomes ``[a[0-9]]``), which llguidance's regex syntax allows.
"""

from __future__ import annotations

import json
from typing import Any

_SPACES = r"\t\n\v\f\r\x20\xA0"  # xgrammar's \s: tab, newline, vertical tab, form feed, return, space, NBSP
_CLASSES = {
    "d": "[0-9]", "D": "[^0-9]",
    "w": "[a-zA-Z0-9_]", "W": "[^a-zA-Z0-9_]",
    "s": f"[{_SPACES}]", "S": f"[^{_SPACES}]",
}
# Keywords whose value is a subschema, a list of them, or a name -> subschema map (other keywords,
# const, enum, default and examples among them, hold data, whose strings are left alone).
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
        "not", "if", "then", "else", "contains", "propertyNames")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "$defs", "definitions", "dependentSchemas")


def ascii_classes(regex: str) -> str:
    """``regex`` with its class escapes made ASCII (an escaped backslash stays one)."""
    if "\\" not in regex:
        return regex
    out: list[str] = []
    index, end = 0, len(regex)
    while index < end:
        char = regex[index]
        if char == "\\" and index + 1 < end:
            escaped = regex[index + 1]
            out.append(_CLASSES.get(escaped) or char + escaped)
            index += 2
        else:
            out.append(char)
            index += 1
    return "".join(out)


def ascii_schema_text(text: str) -> str:
    """A JSON schema's text with the regexes of its ``pattern`` and ``patternProperties`` made ASCII
    (the text itself when it holds no backslash). Raises ValueError on text that is not JSON."""
    if "\\" not in text:
        return text
    try:
        return json.dumps(_schema(json.loads(text)))
    except RecursionError as error:
        raise ValueError("JSON schema nested too deeply") from error


def _schema(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ascii_classes(out["pattern"])
    named = out.get("patternProperties")
    if isinstance(named, dict):
        out["patternProperties"] = {ascii_classes(key): _schema(value) for key, value in named.items()}
    for key in _ONE:
        if key in out:
            value = out[key]
            out[key] = [_schema(item) for item in value] if isinstance(value, list) else _schema(value)
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_schema(item) for item in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: _schema(value) for name, value in out[key].items()}
    return out
