"""EAGLE-3 speculation (``method: eagle3``) on tiny random heads of the right shapes.

The head's drafts against a reference written here in plain torch from transformers' hidden states
(the residual stream entering the fused layers), after a prefill and after a later step (the head's
catch-up from where its KV stopped); the engine's greedy and seeded rows identical to the same rows
kept from speculating, with drafts proposed and counted and the KV invariants checked every step;
heads that cannot serve the target refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from vllm_actors import LLM, SamplingParams
from vllm_actors.actors.worker.eagle3 import Eagle3Proposer
from vllm_actors.actors.worker.step_data import BatchInput, WorkerRequest
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.eagle3 import Eagle3Config
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.speculative import WORKER_DRAFT, SpeculativeConfig, parse_speculative_config

AUX = (0, 1, 2)  # the tiny targets' 3 layers: vLLM's default (2, L // 2, L - 3)


def build_head(target: Path, folder: Path, **changes: object) -> Path:
    """A random EAGLE-3 head for ``target`` (a draft vocabulary of every second target id)."""
    t = json.loads((target / "config.json").read_text())
    hidden, heads, kv_heads, head_dim, inter = (t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"],
                                                t["head_dim"], t["intermediate_size"])
    vocab = t["vocab_size"]
    draft_vocab = vocab // 2
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "intermediate_size": inter, "num_hidden_layers": 1, "vocab_size": vocab,
              "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": t["max_position_embeddings"], "torch_dtype": "float32", **changes}
    generator = torch.Generator().manual_seed(11)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.input_layernorm.weight": 1 + rand(hidden),
        "midlayer.hidden_norm.weight": 1 + rand(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden),
        "norm.weight": 1 + rand(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": torch.arange(draft_vocab),  # draft id i is target id 2 i
    }
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    dim = x.shape[-1]
    angles = positions[:, None].float() / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), -1) * sin


def reference_drafts(target: Path, head: Path, tokens: list[int], k: int) -> list[int]:
    """vLLM's proposer in plain torch: position p reads (token p + 1, fc(target states at p)); the
    drafts after the last known token, each pass's pre-norm output fed back with its draft."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    with torch.no_grad():
        states = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    w = _load(head)
    cfg = json.loads((head / "config.json").read_text())
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    embed = model.get_input_embeddings().weight.detach()
    hidden = list(torch.cat([states[i][0] for i in AUX], -1) @ w["fc.weight"].T)
    inputs = list(tokens[1:])
    drafts: list[int] = []
    for _ in range(k):
        e = _rms(embed[torch.tensor(inputs)], w["midlayer.input_layernorm.weight"])
        h = torch.stack(hidden)
        x = torch.cat((e, _rms(h, w["midlayer.hidden_norm.weight"])), -1)
        positions = torch.arange(len(inputs))
        q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, heads, dim), positions)
        key = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, kv_heads, dim), positions)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
        key, v = (t.repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for t in (key, v))
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), key, v, is_causal=True).transpose(0, 1)
        r = attn.reshape(len(inputs), -1) @ w["midlayer.self_attn.o_proj.weight"].T + h
        m = _rms(r, w["midlayer.post_attention_layernorm.weight"])
        pre = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
               ) @ w["midlayer.mlp.down_proj.weight"].T + r
        draft = int((_rms(pre[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
        drafts.append(draft + int(w["d2t"][draft]))
        inputs.append(drafts[-1])
        hidden.append(pre[-1])
    return drafts


def _load(head: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(head / "model.safetensors"))


@pytest.fixture(scope="module")
def llama_head(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_head(tiny_llama, tmp_path_factory.mktemp("eagle3") / "head")


def _spec(head: Path, k: int = 3) -> SpeculativeConfig:
    return parse_speculative_config({"method": "eagle3", "model": str(head), "num_speculative_tokens": k},
                                    adaptive=False)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_heads_drafts_are_vllms_from_the_targets_hidden_states(
        family: str, tiny_llama: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    """A prefill, then a step of two more tokens: each proposal is the reference's over all tokens."""
    from vllm_actors.runner.model_runner import ModelRunner

    target = tiny_llama if family == "llama" else tiny_qwen3
    head = build_head(target, tmp_path / "head")
    runner = ModelRunner(EngineConfig(model=str(target), dtype="float32", block_size=4, max_model_len=64,
                                      num_gpu_blocks_override=12, speculative_config=_spec(head)))
    proposer = Eagle3Proposer(runner.drafter)
    table = [7, 2, 9, 4, 11]
    tokens = [(i * 37 + 5) % 500 for i in range(9)]
    request = WorkerRequest("r", token_ids=tokens[:6], num_prompt_tokens=5, num_output_tokens=1,
                            params=SamplingParams(), eos_token_ids=[], block_table=table)

    def target_step(start: int, end: int) -> None:  # the target computes positions start..end-1
        runner.execute(BatchInput(tokens[start:end], list(range(start, end)), [end - start], [end], [table],
                                  [end - start - 1]))

    def propose() -> list[int]:
        plan = StepPlan(step_id=0, req_ids=["r"], num_tokens=[4], new_block_ids=[[]],
                        draft_token_ids={"r": [WORKER_DRAFT] * 3})
        return list(proposer.propose(plan, {"r": request}).draft_token_ids["r"])

    target_step(0, 5)
    assert propose() == reference_drafts(target, head, request.token_ids, 3)
    target_step(5, 7)  # a verification that kept one draft: two more positions computed
    request.token_ids = tokens[:8]
    assert propose() == reference_drafts(target, head, request.token_ids, 3)


def test_eagle3_gives_the_tokens_of_no_speculation(tiny_llama: Path, llama_head: Path) -> None:
    """Greedy and seeded rows; beside each, the same row with penalties and a logit bias."""
    prompts = [[(i * 7 + j * 3) % 500 for j in range(5 + 9 * i)] for i in range(3)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    controlled = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=10, ignore_eos=True,
                                 presence_penalty=1.0, frequency_penalty=0.5, logit_bias={7: 4.0}) for p in params]
    got: list[list[list[int]]] = []
    for speculative in (None, _spec(llama_head)):
        with LLM(str(tiny_llama), dtype="float32", executor="inprocess", speculative_config=speculative,
                 block_size=4, max_model_len=128, max_num_batched_tokens=16, num_gpu_blocks_override=40,
                 check_invariants=True) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params + controlled, use_tqdm=False)
            spec = llm.get_metrics().spec_decode
        got.append([list(output.outputs[0].token_ids) for output in outputs])
    expected, speculated = got
    assert speculated == expected
    assert expected[: len(params)] != expected[len(params):]  # the controls matter
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_drafts


def test_heads_that_cannot_serve_the_target_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    target = ModelConfig.from_path(str(tiny_llama))
    cases = [({"hidden_size": 32}, "reads hidden states of size 32"),
             ({"vocab_size": 600}, "vocab_size 600"),
             ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
             ({"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}, "three distinct layers")]
    for index, (changes, message) in enumerate(cases):
        folder = tmp_path / f"h{index}"
        folder.mkdir()
        head_config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                       "num_hidden_layers": 1, "vocab_size": target.vocab_size, **changes}
        (folder / "config.json").write_text(json.dumps(head_config))
        with pytest.raises(ValueError, match=message):
            Eagle3Config.from_path(str(folder), target)
    with pytest.raises(ValueError, match="needs a target of the families"):
        Eagle3Config.from_path(str(folder), dataclasses.replace(target, architecture="gemma2"))
