"""X-Request-Id as vLLM takes it: any length and any characters, quoted back as sent in the response's
``id`` (the engine runs under an id derived from it when it is no valid engine id), and with
``--enable-request-id-headers`` echoed in a response header (a random one without it)."""

from __future__ import annotations

import pytest

from tests.support.fake_served import Env, asgi, env, served_app, tokenizer  # noqa: F401
from vllm_actors.cli import build_parser
from vllm_actors.protocol.names import engine_request_id_error, fit_request_id
from vllm_actors.server.app_settings import AppSettings

LONG_ID = "trace 7/é#1:" + "x" * 288  # 300 characters; a space, a slash, a '#', a non-ASCII letter


def test_an_id_fits_the_engine_unchanged_or_derived_from_it_alone() -> None:
    assert fit_request_id("cmpl-abc-0") == "cmpl-abc-0"
    derived = fit_request_id(f"cmpl-{LONG_ID}-0")
    assert engine_request_id_error(derived) is None and derived.startswith("cmpl-trace_7__")
    assert derived != fit_request_id(f"cmpl-{LONG_ID}-1")  # the whole id decides, not its start


@pytest.mark.asyncio
async def test_a_300_character_id_is_served_quoted_and_echoed(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    args = build_parser().parse_args(["serve", "m", "--enable-request-id-headers"])
    settings = AppSettings.from_args(args, max_num_seqs=8, api_keys=[])
    header = LONG_ID.encode("utf-8").decode("latin-1")  # what a server reads from the header's bytes
    async with served_app(env, monkeypatch) as (client, plain), asgi(settings.build(client)) as http:
        for path, body, prefix in (("/v1/completions", {"prompt": "Hello"}, "cmpl"),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                                    "chatcmpl")):
            reply = await http.post(path, json={"model": "fake", "max_tokens": 2, **body},
                                    headers={"X-Request-Id": LONG_ID.encode()})
            assert reply.status_code == 200, reply.text
            assert reply.json()["id"] == f"{prefix}-{header}"
            assert dict(reply.headers.raw)[b"x-request-id"] == LONG_ID.encode()  # byte for byte
        random_id = (await http.get("/v1/models")).headers["x-request-id"]  # none sent: a random one
        assert len(random_id) == 32 and int(random_id, 16) >= 0
        async with asgi(plain) as default:  # vLLM's default: no header added
            assert "x-request-id" not in (await default.get("/v1/models")).headers
