"""LoRA adapters in the model: PEFT adapters made by peft, loaded into the device slots and
applied per token; the logits of a batch mixing two adapters and the base match transformers +
PEFT in float32 (Qwen3 and Llama; the Triton kernels too, in the interpreter: a 9-token step through
the sorted kernels, a 7-token one through the per-row kernels); bad adapters are refused before anything is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.lora_adapters import ATTENTION, build_adapter, reference_logits
from tests.support.tiny_models import PagedRunner
from vllm_actors.lora.adapter import read_adapter
from vllm_actors.lora.manager import LoRAManager
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.loader import load_model
from vllm_actors.protocol.lora import LoRARequest

PROMPTS = {0: [5, 17, 42, 7, 99, 3, 11], 1: [200, 201, 202, 9], 2: [300, 301, 302, 303, 304]}


@pytest.fixture(scope="module")
def adapters(tiny_qwen3: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_model")
    return {
        "qwen3_all": build_adapter(tiny_qwen3, root / "qwen3_all", rank=8, seed=1),
        "qwen3_attn": build_adapter(tiny_qwen3, root / "qwen3_attn", targets=ATTENTION, rank=4, seed=2,
                                    use_rslora=True),
        "llama_all": build_adapter(tiny_llama, root / "llama_all", rank=8, seed=3),
        "llama_mlp": build_adapter(tiny_llama, root / "llama_mlp", targets=("gate_proj", "down_proj"), rank=16,
                                   seed=4),
    }


@pytest.mark.parametrize("arch, kernel", [("qwen3", "torch"), ("llama", "torch"), ("qwen3", "triton")])
def test_mixed_batch_matches_peft(arch: str, kernel: str, adapters: dict[str, Path], request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_LORA_KERNEL", kernel)
    base = request.getfixturevalue(f"tiny_{arch}")
    first, second = [adapters[name] for name in adapters if name.startswith(arch)]
    model, _ = load_model(str(base), torch.float32, torch.device("cpu"))
    manager = LoRAManager(model, max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_tokens=64,
                          device=torch.device("cpu"), dtype=torch.float32)
    loras = [LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second)), None]
    runner = PagedRunner(model, block_size=4)
    chunks = {seq: PROMPTS[seq][:3] for seq in PROMPTS}  # a prefill in two chunks, then the rest
    manager.prepare(loras, [len(c) for c in chunks.values()])
    got = {seq: [logits] for seq, logits in runner.step(chunks).items()}
    chunks = {seq: PROMPTS[seq][3:] for seq in PROMPTS}
    manager.prepare(loras, [len(c) for c in chunks.values()])
    for seq, logits in runner.step(chunks).items():
        got[seq].append(logits)
    for seq, adapter in zip(PROMPTS, (first, second, None)):
        want = reference_logits(base, adapter, PROMPTS[seq])
        torch.testing.assert_close(torch.cat(got[seq]), want, atol=1e-4, rtol=1e-4)
    base_logits = reference_logits(base, None, PROMPTS[0])
    assert (torch.cat(got[0]) - base_logits).abs().max() > 1e-2  # the adapter matters


def test_slots_are_reused_least_recently_used_first(tiny_qwen3: Path, adapters: dict[str, Path]) -> None:
    model, _ = load_model(str(tiny_qwen3), torch.float32, torch.device("cpu"))
    manager = LoRAManager(model, max_loras=1, max_lora_rank=8, max_cpu_loras=1, max_tokens=16,
                          device=torch.device("cpu"), dtype=torch.float32)
    one, two = LoRARequest("a", 1, str(adapters["qwen3_all"])), LoRARequest("b", 2, str(adapters["qwen3_attn"]))
    manager.prepare([one, None], [2, 1])
    assert manager.batch.token_slots[:4].tolist() == [0, 0, -1, -1]
    manager.prepare([two], [1])
    assert list(manager.slots) == [2] and list(manager.cpu) == [2]
    assert manager.batch.token_slots[:3].tolist() == [0, -1, -1]
    with pytest.raises(ValueError, match="more than max_loras=1"):
        manager.prepare([one, two], [1, 1])
    manager.prepare([None], [1])
    assert manager.batch.token_slots[:3].tolist() == [-1, -1, -1]


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_bad_adapters_are_refused(tiny_qwen3: Path, tiny_llama: Path, adapters: dict[str, Path],
                                  tmp_path: Path) -> None:
    qwen3 = ModelConfig.from_path(str(tiny_qwen3))
    with pytest.raises(ValueError, match="LoRA rank 8 is greater than max_lora_rank 4"):
        read_adapter(str(adapters["qwen3_all"]), qwen3, max_lora_rank=4)
    llama_tp = ModelConfig.from_path(str(tiny_llama))
    wider = ModelConfig.from_dict({**llama_tp.to_dict(), "intermediate_size": 256})
    with pytest.raises(ValueError, match="another base model"):
        read_adapter(str(adapters["llama_mlp"]), wider, max_lora_rank=16)
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        read_adapter(str(tmp_path), qwen3, max_lora_rank=16)
    with pytest.raises(ValueError, match="not a directory"):
        read_adapter(str(tmp_path / "nowhere"), qwen3, max_lora_rank=16)
    dora = tmp_path / "dora"
    build_adapter(tiny_qwen3, dora, targets=("q_proj",), rank=2)
    _edit_config(dora, use_dora=True)
    with pytest.raises(ValueError, match="use_dora"):
        read_adapter(str(dora), qwen3, max_lora_rank=16)
    head = tmp_path / "head"
    build_adapter(tiny_qwen3, head, targets=("q_proj", "lm_head"), rank=2)
    with pytest.raises(ValueError, match="lm_head.*not support"):
        read_adapter(str(head), qwen3, max_lora_rank=16)
