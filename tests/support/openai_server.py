"""One ``vllm-actors serve`` process group on the tiny Qwen3 per test module (the module-scoped
fixtures ``server_process``, ``reference`` and ``served``: a module imports their functions), the
greedy outputs of the offline ``LLM`` to compare with, and invalid requests with the answer each must
get."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.support.server_helpers import free_port, start_server, stop_process, wait_healthy
from vllm_actors import LLM, SamplingParams
from vllm_actors.runtime.run_dir import GroupInfo, read_group_info

MODEL_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 256
NUM_BLOCKS = 1024  # small: the KV-cache manager checks its whole pool after every step in tests
PROMPTS = ["The quick brown fox", "Hello world! How are you", "Once upon a time there was", "The capital of France"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to ten."}],
]
STREAM_PROMPTS = [f"The number {i} is" for i in range(64)]
MAX_TOKENS = 16
STREAM_MAX_TOKENS = 8


@dataclass
class Served:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    info: GroupInfo

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)


@dataclass
class Reference:
    completions: dict[str, str]
    chats: list[str]
    streams: dict[str, str]
    first_ids: list[int]  # greedy output token ids of PROMPTS[0]


@pytest.fixture(scope="module", name="server_process")
def server_process_fixture(
    tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path, Path]]:
    directory = tmp_path_factory.mktemp("srv")
    run_root, log_path, port = directory / "runs", directory / "server.log", free_port()
    process = start_server(tiny_qwen3, port, log_path, run_root, "--served-model-name", MODEL_NAME,
                           "--max-model-len", str(MAX_MODEL_LEN), "--shutdown-timeout", "60",
                           "--num-gpu-blocks-override", str(NUM_BLOCKS))
    try:
        yield process, port, log_path, run_root
    finally:
        stop_process(process)


@pytest.fixture(scope="module", name="reference")
def reference_fixture(server_process, tiny_qwen3: Path) -> Reference:
    """Greedy outputs of the offline LLM (computed while the server starts)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(str(tiny_qwen3), dtype="float32", executor="inprocess", max_model_len=MAX_MODEL_LEN,
             num_gpu_blocks_override=NUM_BLOCKS) as llm:
        outputs = llm.generate(PROMPTS + STREAM_PROMPTS,
                               [greedy] * len(PROMPTS)
                               + [greedy.clone(max_tokens=STREAM_MAX_TOKENS)] * len(STREAM_PROMPTS),
                               use_tqdm=False)
        chats = llm.chat(CHATS, greedy, use_tqdm=False)
    texts = [output.outputs[0].text for output in outputs]
    return Reference(
        completions=dict(zip(PROMPTS, texts[: len(PROMPTS)], strict=True)),
        chats=[output.outputs[0].text for output in chats],
        streams=dict(zip(STREAM_PROMPTS, texts[len(PROMPTS):], strict=True)),
        first_ids=list(outputs[0].outputs[0].token_ids),
    )


@pytest.fixture(scope="module", name="served")
def served_fixture(server_process, reference) -> Served:
    process, port, log_path, run_root = server_process
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(base_url, process, log_path)
    (run_dir,) = [path.parent for path in run_root.glob("*/group.json")]
    return Served(base_url, process, log_path, read_group_info(run_dir))


# Invalid requests: (name, path, body, status, the field the error names).
LONG_PROMPT = list(range(3, 3 + 300))  # 300 token ids > max_model_len
INVALID: list[tuple[str, str, object, int, str | None]] = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("body is a list", "/v1/completions", [1, 2], 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("prompt missing", "/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("temperature not a number", "/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("temperature negative", "/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("top_p above 1", "/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", "/v1/completions", {"prompt": "a", "top_k": -5}, 400, "top_k"),
    ("min_p above 1", "/v1/completions", {"prompt": "a", "min_p": 2}, 400, "min_p"),
    ("max_tokens zero", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens a string", "/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("n zero", "/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("logprobs too many", "/v1/completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("seed over 64 bits", "/v1/completions", {"prompt": "a", "seed": 2**64 - 1, "n": 2}, 400, "seed"),
    ("stop not a string", "/v1/completions", {"prompt": "a", "stop": 123}, 400, "stop"),
    ("stream not a bool", "/v1/completions", {"prompt": "a", "stream": "maybe"}, 400, "stream"),  # "yes": true
    ("stream_options without stream", "/v1/completions",
     {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("presence_penalty out of range", "/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("prompt an empty list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("prompt mixed list", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {"prompt": [1, 100000]}, 400, "prompt_token_ids"),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "a"}, 404, "model"),
    ("prompt longer than max_model_len", "/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("prompt plus max_tokens over max_model_len", "/v1/completions", {"prompt": "Hello", "max_tokens": 255}, 400,
     "max_tokens"),
    ("messages missing", "/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("messages empty", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("image content part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ("max_completion_tokens negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, 400, "max_tokens"),
    ("unknown chat model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("chat over max_model_len", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    ("tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
]


