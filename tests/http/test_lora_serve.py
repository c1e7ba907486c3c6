"""LoRA adapters through ``vllm-actors serve`` (vLLM's OpenAI-server LoRA tests' shape): adapters
from ``--lora-modules`` (name=path and vLLM's JSON) served as model names, listed in /v1/models
with the base as parent, greedy tokens equal to transformers + PEFT; with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` adapters loaded and unloaded at run time, bad ones refused (400,
nothing loaded; a path with no adapter 404, as vLLM); without it the endpoints do not exist."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.fake_served import Env, asgi, env, served_app, tokenizer  # noqa: F401
from tests.support.lora_adapters import ATTENTION, build_adapter, reference_greedy
from tests.support.server_helpers import served_url

PROMPT = [5, 17, 42, 7, 99, 3, 11]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_serve")
    return {"a": build_adapter(tiny_qwen3, root / "a", rank=8, seed=31),
            "b": build_adapter(tiny_qwen3, root / "b", targets=ATTENTION, rank=4, seed=32),
            "c": build_adapter(tiny_qwen3, root / "c", targets=("v_proj", "down_proj"), rank=8, seed=33),
            "big": build_adapter(tiny_qwen3, root / "big", targets=("q_proj",), rank=32, seed=34)}


@pytest.fixture(scope="module")
def url(tiny_qwen3: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    b = json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": "base"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        with served_url(tiny_qwen3, tmp_path_factory.mktemp("lora_serve_run"), "--served-model-name", "base",
                        "--max-model-len", "128", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                        "--lora-modules", f"a={adapters['a']}", b) as base_url:
            yield base_url


def _greedy(url: str, model: str) -> tuple[int, list[int]]:
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    if reply.status_code != 200:
        return reply.status_code, []
    body = reply.json()
    assert body["model"] == model
    return 200, [int(token.removeprefix("token_id:")) for token in body["choices"][0]["logprobs"]["tokens"]]


def _models(url: str) -> dict[str, dict[str, object]]:
    return {card["id"]: card for card in httpx.get(f"{url}/v1/models").json()["data"]}


def test_adapters_are_model_names(url: str, tiny_qwen3: Path, adapters: dict[str, Path]) -> None:
    models = _models(url)
    assert set(models) == {"base", "a", "b"}
    assert models["a"]["parent"] == models["b"]["parent"] == "base" and models["base"]["parent"] is None
    assert models["a"]["root"] == str(adapters["a"])
    for model, adapter in (("a", adapters["a"]), ("b", adapters["b"]), ("base", None)):
        assert _greedy(url, model) == (200, reference_greedy(tiny_qwen3, adapter, PROMPT, MAX_TOKENS)), model
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "b"


def test_load_and_unload_at_run_time(url: str, tiny_qwen3: Path, adapters: dict[str, Path]) -> None:
    load = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'c' added successfully."
    assert "c" in _models(url)
    assert _greedy(url, "c") == (200, reference_greedy(tiny_qwen3, adapters["c"], PROMPT, MAX_TOKENS))
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'c' has already been loaded."
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'c' removed successfully."
    assert "c" not in _models(url) and _greedy(url, "c")[0] == 404
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The lora adapter 'c' cannot be found."


@pytest.mark.parametrize("body, status, message", [
    ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "x", "lora_path": "/nowhere/at/all"}, 404,
     "Loading lora x failed: No adapter found for /nowhere/at/all"),
    ({"lora_name": "x", "lora_path": "BIG"}, 400, "LoRA rank 32 is greater than max_lora_rank 16"),
])
def test_bad_adapters_are_refused(url: str, adapters: dict[str, Path], body: dict[str, str], status: int,
                                  message: str) -> None:
    if body.get("lora_path") == "BIG":
        body = {**body, "lora_path": str(adapters["big"])}
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert reply.status_code == status and message in reply.json()["error"]["message"]
    assert "x" not in _models(url)


@pytest.mark.asyncio
async def test_runtime_endpoints_need_the_setting(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert (await http.post(path, json={"lora_name": "a", "lora_path": "/a"})).status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:  # LoRA off in this engine
        reply = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert reply.status_code == 400 and "LoRA is not enabled" in reply.json()["error"]["message"]
