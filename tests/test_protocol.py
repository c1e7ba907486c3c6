"""The wire contract: schemas in protocols/ match the code; strict decoding; layering rules."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from vllm_actors.protocol.codec import MessageCodec, json_schema_texts
from vllm_actors.protocol.messages import AddRequest, Logprobs, StepPlan, StepResult
from vllm_actors.protocol.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vllm_actors"


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


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_protocol_imports_nothing_of_the_project_but_itself() -> None:
    for path in (PACKAGE / "protocol").glob("*.py"):
        project = {name for name in _imports(path) if name.startswith("vllm_actors")}
        assert all(name.startswith("vllm_actors.protocol") for name in project), path


def test_bookkeeping_actors_import_no_torch_and_no_zmq() -> None:
    for name in ("scheduler/scheduler.py", "kv_cache_manager/manager.py", "frontend/frontend.py"):
        imported = _imports(PACKAGE / "actors" / name)
        assert not {"torch", "zmq"} & {module.split(".")[0] for module in imported}, name
    code = (
        "import sys, vllm_actors, vllm_actors.actors.scheduler.scheduler, vllm_actors.actors.kv_cache_manager.manager, "
        "vllm_actors.actors.frontend.frontend, vllm_actors.protocol.config; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_token_ids_pack_as_little_endian_int32_and_round_trip() -> None:
    from vllm_actors.protocol.messages import pack_token_ids, unpack_token_ids

    ids = [0, 1, 151_935, 2**31 - 1]
    packed = pack_token_ids(ids)
    assert packed == b"".join(i.to_bytes(4, "little") for i in ids)
    assert unpack_token_ids(packed) == ids
    with pytest.raises(ValueError, match="4 bytes"):
        unpack_token_ids(packed[:-1])
