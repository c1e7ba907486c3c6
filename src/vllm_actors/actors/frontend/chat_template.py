"""Render Hugging Face style chat templates (Jinja2) in a sandbox.

The environment matches what model authors write templates against: ``trim_blocks`` and
``lstrip_blocks`` on, the ``loopcontrols`` extension, a ``{% generation %}`` block tag (rendered
as its body), ``raise_exception(msg)``, ``strftime_now(fmt)``, and a ``tojson`` filter that keeps
non-ASCII characters and does not HTML-escape. The template sees ``messages``,
``add_generation_prompt``, the special token strings (``bos_token``, ``eos_token``, ...) and any
extra keyword arguments (``tools``, ``documents``, ``enable_thinking``...).

This module must not import torch or transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import structlog

log = structlog.get_logger(__name__)

DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or called raise_exception()."""


class MissingChatTemplateError(ChatTemplateError):
    """The tokenizer has no chat template and none was passed."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False
) -> str:
    # Unlike Jinja's built-in filter: no HTML escaping, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; rendering
    only needs its body."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 declares it as an instance attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc} (line {exc.lineno})") from exc


def select_chat_template(templates: Mapping[str, str], override: str | None = None, *, has_tools: bool = False) -> str:
    """Pick the template text: ``override`` is a template name or the template itself; otherwise
    "tool_use" when tools are given and the model has one, else "default"."""
    if override is not None:
        return templates.get(override, override)
    if has_tools and TOOL_USE_TEMPLATE_NAME in templates:
        return templates[TOOL_USE_TEMPLATE_NAME]
    if DEFAULT_TEMPLATE_NAME in templates:
        return templates[DEFAULT_TEMPLATE_NAME]
    if templates:
        names = ", ".join(sorted(templates))
        raise MissingChatTemplateError(
            f"the model has named chat templates ({names}) but no 'default' one; pass chat_template=<name>"
        )
    raise MissingChatTemplateError(
        "this model has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja, "
        "no tokenizer.chat_template in the GGUF); pass chat_template=... or use a plain text prompt"
    )


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """Render ``template`` for ``messages``. ``special_tokens`` maps variable names such as
    "bos_token" to their strings (unset ones left undefined); ``extra`` variables (tools,
    documents, enable_thinking...) are passed as given, None included."""
    context: dict[str, Any] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    context.update(extra)
    context["messages"] = [dict(m) for m in messages]
    context["add_generation_prompt"] = add_generation_prompt
    compiled = compile_chat_template(template)
    try:
        return compiled.render(**context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
