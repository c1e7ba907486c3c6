"""Shared pytest fixtures: tiny HF checkpoints built on the spot and the embedded default GGUF model;
the environment every test runs in; the order pytest-xdist hands the files out in."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    # Triton kernels run through its interpreter on CPU-only machines (CI). The flag is read when
    # kernels are decorated, so it is set here, before any test module imports them.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path
from typing import Any

import pytest

# Every KV-cache manager checks its pool's accounting after every step, in process and in groups.
os.environ.setdefault("VLLM_ACTORS_CHECK_INVARIANTS", "1")
# A CPU worker zero-fills its whole KV pool at start (1 GiB by default). Half of it still holds the
# embedded model's full context (8,192 tokens take 0.35 GiB in float32) and no test counts on the
# default size; tests that need a given pool set num_gpu_blocks_override.
os.environ.setdefault("VLLM_ACTORS_CPU_KVCACHE_SPACE", "0.5")
# Under pytest-xdist the test processes share the cores: each takes its share of torch threads, and
# so do the actor processes it starts (torch's default of one spinning thread per core in every one
# of them oversubscribed the two cores and made the parallel suite slower than the serial one).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("VLLM_ACTORS_WORKER_THREADS", str(_share))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(_share)

from tests.support.tiny_models import THINK_TOKENS, build_checkpoint  # noqa: E402

TESTS = Path(__file__).resolve().parent
SHORT_BASETEMP = pytest.StashKey[str]()
# Under pytest-xdist (scripts/test.sh: --dist loadfile --no-loadscope-reorder) each file goes whole to
# one worker, in collection order: the folders whose files start process groups come first, so the
# files handed out last are short ones and the workers finish together. Other folders go first.
XDIST_FOLDER_ORDER = ("process_group", "http", "engine", "bench", "models", "runtime", "kernels", "clients",
                      "state_machines", "layout", "gpu")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, every temporary folder goes under a short new one (/tmp/pt-XXXXXXXX/popen-gwN):
    pytest's (/tmp/pytest-of-USER/pytest-N/popen-gwN/TEST_NAME) took a group's IPC socket paths past
    the 107 bytes of a Unix socket address. Removed at the end of a run that passed."""
    if config.getoption("dist", "no") != "no" and config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="pt-")
        config.stash[SHORT_BASETEMP] = config.option.basetemp


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    basetemp = session.config.stash.get(SHORT_BASETEMP, None)
    if basetemp is not None and exitstatus == 0:
        shutil.rmtree(basetemp, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # a plain run keeps pytest's order
        return

    def rank(item: pytest.Item) -> int:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        return XDIST_FOLDER_ORDER.index(folder) if folder in XDIST_FOLDER_ORDER else -1

    items.sort(key=rank)  # stable: inside a folder, pytest's order


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3 checkpoint: tied embeddings, a single safetensors file."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", tie_word_embeddings=True, num_shards=1)


@pytest.fixture(scope="session")
def tiny_qwen3_thinking(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3 whose tokenizer has <think> and </think> tokens (ids 512 and 513): a reasoning model's."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_thinking"), "qwen3", tie_word_embeddings=True,
                            added_tokens=THINK_TOKENS)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Llama checkpoint: untied lm_head, several safetensors shards plus the index json."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", tie_word_embeddings=False, num_shards=3)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3-MoE: 4 experts, top-2 not renormalised, layer 1 dense; tied embeddings."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", tie_word_embeddings=True, seed=7)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Mixtral: 4 experts in every layer, top-2 renormalised; untied lm_head, 2 shards."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", tie_word_embeddings=False,
                            num_shards=2, seed=8)


# Shapes that split over 2 and 3 ranks: 6 query heads, intermediate 96. Qwen3 with one KV head
# (replicated on every rank), Llama with six (split).
TP_QWEN3_SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1, "intermediate_size": 96}
TP_LLAMA_SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 96}


@pytest.fixture(scope="session")
def tiny_qwen3_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 for tensor parallelism: 6 heads, 1 KV head (replicated at TP=2 and 3), tied embeddings."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_tp"), "qwen3", tie_word_embeddings=True,
                            shape=TP_QWEN3_SHAPE)


@pytest.fixture(scope="session")
def tiny_llama_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama for tensor parallelism: 6 heads, 6 KV heads (split), untied lm_head, 2 shards."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_llama_tp"), "llama", tie_word_embeddings=False,
                            num_shards=2, shape=TP_LLAMA_SHAPE)


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF; skips the test when it is not installed."""
    from vllm_actors.default_model import default_model_path

    try:
        return default_model_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def hf_default_gguf_model(default_gguf_path: str) -> Any:
    """transformers' model of the embedded GGUF (float32, eval): the reference, loaded once.

    Loading took ~14 s on 2 cores, little of it dequantisation: transformers builds gguf's tensor
    name map once per module of the model (397 times, ~4.5 s) and parses the file's header (49k
    token strings) once for the config and again for the weights (~2.4 s). Both are pure functions
    of their arguments, so they are memoised for this one load (~7 s); the weights are the same."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(default_gguf_path), gguf_file=os.path.basename(default_gguf_path), dtype=torch.float32
        ).eval()


@pytest.fixture(autouse=True)
def _kv_invariants_after_each_test():
    """After every test: each live in-process engine with nothing unfinished has handed every KV
    block back (free + in use = total, no block held for a finished request)."""
    yield
    from vllm_actors.clients.inprocess import InProcessEngine

    for engine in list(InProcessEngine.live):
        if not engine.has_unfinished:
            engine.check_idle_invariants()
