"""The wire contract: schemas in protocols/ match the code; strict decoding. Layering rules: test_layout.py."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from vllm_actors.protocol.codec import MessageCodec, json_schema_texts
from vllm_actors.protocol.messages import AddRequest, Logprobs, StepPlan, StepResult
from vllm_actors.protocol.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_exported_schemas_match_the_code() -> None:
    for name, text in json_schema_texts().items():
        exported = (ROOT / "protocols" / name).read_text()
        assert json.loads(exported) == json.loads(text), (
            f"protocols/{name} is stale: run `python -m vllm_actors.protocol`"
        )


def test_round_trip_and_strict_decoding() -> None:
    codec = MessageCodec()
    messages = [
        AddRequest(request_id="a", prompt_token_ids=[1, 2], params=SamplingParams(seed=3), eos_token_ids=[0]),
        StepPlan(step_id=4, req_ids=["a"], num_tokens=[2], num_blocks=[1], new_block_ids=[[7]]),
        StepResult(step_id=4, req_ids=["a"], token_ids=[9], logprobs=[Logprobs([9], [-0.5], [1])]),
    ]
    for message in messages:
        assert codec.decode(codec.encode(message)) == message
    wrong_type = msgspec.msgpack.encode({"type": "step_plan", "step_id": "four"})
    for frame in (b"\x00\x01garbage", codec.encode(messages[1])[:-3], wrong_type,
                  msgspec.msgpack.encode({"type": "no_such_message"})):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            codec.decode(frame)


def test_token_ids_pack_as_little_endian_int32_and_round_trip() -> None:
    from vllm_actors.protocol.token_ids import pack_token_ids, unpack_token_ids

    ids = [0, 1, 151_935, 2**31 - 1]
    packed = pack_token_ids(ids)
    assert packed == b"".join(i.to_bytes(4, "little") for i in ids)
    assert unpack_token_ids(packed) == ids
    with pytest.raises(ValueError, match="4 bytes"):
        unpack_token_ids(packed[:-1])
