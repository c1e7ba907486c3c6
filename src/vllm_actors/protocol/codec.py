"""Encoding and strict decoding of messages (msgpack on the wire, JSON Schema for the docs)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from vllm_actors.protocol.messages import ALL_MESSAGES, PROTOCOL_VERSION, Message


class MessageCodec:
    """Encodes any ``Message``; decodes bytes strictly into the tagged union or raises
    ``msgspec.DecodeError`` / ``msgspec.ValidationError`` (callers log and drop the frame)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Message:
        return self._decoder.decode(data)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of every message, as exported to ``protocols/messages.schema.json``."""
    schemas, components = msgspec.json.schema_components(ALL_MESSAGES, ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "vllm_actors messages",
        "protocol_version": PROTOCOL_VERSION,
        "oneOf": schemas,
        "$defs": components,
    }


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
