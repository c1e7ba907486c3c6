"""GGUF files in the K-quant mixes users download (Q4_K_M, Q5_K_M, Q6_K) and Q8_0, written here from
a tiny Llama with the `gguf` package: they load (dequantized at load time) and give the logits and
greedy tokens of transformers on the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.support.gguf_kquants import PRESETS, SHAPE, build_kquant_gguf
from tests.support.tiny_models import PagedRunner, build_checkpoint
from vllm_actors.models.config import read_gguf_header
from vllm_actors.models.loader import load_model

PROMPT = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def tiny_llama_256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama256"), "llama", tie_word_embeddings=False, seed=3,
                            shape=SHAPE)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_kquant_file_matches_transformers(preset: str, tiny_llama_256: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    gguf_path, reference = build_kquant_gguf(tiny_llama_256, tmp_path, preset)
    types = {info.name: info.ggml_type for info in read_gguf_header(gguf_path).tensors.values()}
    main, special = PRESETS[preset]
    assert types["blk.0.attn_q.weight"] == Q[main] and types["blk.1.ffn_down.weight"] == Q[special]
    assert types["output.weight"] == Q[special] and types["blk.0.attn_norm.weight"] == Q.F32
    ours, _ = load_model(str(gguf_path), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor([PROMPT])).logits[0]
        generated = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):]
    runner = PagedRunner(ours, block_size=4, num_blocks=64)
    got = torch.cat([runner.step({0: PROMPT[:16]})[0], runner.step({0: PROMPT[16:]})[0]])
    assert expected.std().item() > 0.05  # weights of consequence, not a flat output
    assert (got - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    tokens, logits = [], got[-1:]
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.step({0: tokens[-1:]})[0]
    assert tokens == generated.tolist()
