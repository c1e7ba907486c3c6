"""EAGLE-3 draft heads (speculative decoding, ``method: eagle3``), in the checkpoint format vLLM
and SpecForge/``speculators`` read (``LlamaForCausalLMEagle3``).

A head is one decoder layer over the target's features: ``fc`` fuses the residual stream entering
three of the target's layers (``[T, 3 * hidden]`` -> ``[T, hidden]``; vLLM's default layers 2,
``L // 2`` and ``L - 3``, or the config's ``eagle_aux_hidden_state_layer_ids``); the layer's
attention takes the normed token embedding and the normed fused state side by side (``2 * hidden``
into q, k and v); a final norm and ``lm_head`` over a draft vocabulary, mapped to the target's by
``d2t`` (target id = draft id + ``d2t[draft id]``). The embedding is the target's unless the
checkpoint has its own. The head's pre-norm output is its next position's hidden state (vLLM's
``hidden_prenorm``).

``AuxHiddenStates`` is the target's side: installed as ``CausalLM.aux_hidden``, it takes the
residual stream entering the chosen layers during the target's forward pass, fuses it with the
head's ``fc`` and stores it at each token's KV slot (``fused`` cache: one row per slot of the pool),
so a request's fused states live under its block ids, as its KV does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vllm_actors.kernels.attention import AttentionBackend, AttentionMetadata
from vllm_actors.kernels.fused_ops import rms_norm
from vllm_actors.kernels.gemv import linear
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.hf_loader import load_hf_state_dict, safetensors_files
from vllm_actors.models.llama import MLP, Attention, RMSNorm
from vllm_actors.models.rope import RotaryFrequencies, rope_cos_sin, rope_frequencies

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
TARGET_FAMILIES = ("llama", "qwen3")  # the targets whose forward pass has the hidden-state hook
_MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig  # the head's layer (hidden size, heads, MLP, rope)
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose input streams fc fuses, ascending
    target_hidden_size: int
    norm_before_residual: bool

    @classmethod
    def from_path(cls, path: str, target: ModelConfig) -> Eagle3Config:
        """The head's config.json, checked against the target (``ValueError`` naming what is wrong)."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ValueError(f"speculative_config: the EAGLE-3 head {path!r} has no config.json")
        raw = json.loads(file.read_text())
        archs = raw.get("architectures") or []
        if not any(arch in HEAD_ARCHITECTURES for arch in archs):
            raise ValueError(f"speculative_config: {path!r} is not an EAGLE-3 head (architectures {archs}; "
                             f"expected one of {list(HEAD_ARCHITECTURES)})")
        if target.architecture not in TARGET_FAMILIES:
            raise ValueError(f"speculative_config: method 'eagle3' needs a target of the families {TARGET_FAMILIES} "
                             f"(their forward pass exposes the hidden states), got {target.architecture!r}")
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"speculative_config: the EAGLE-3 head {path!r} has {raw['num_hidden_layers']} layers; "
                             "one is supported")
        model_type = raw.get("model_type", "llama") if raw.get("model_type") in TARGET_FAMILIES else "llama"
        model = ModelConfig.from_hf_config({**raw, "model_type": model_type, "architectures": []}, path=path)
        if model.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head {path!r} has vocab_size {model.vocab_size}, "
                             f"the target {target.vocab_size}: a head must be trained for the target")
        target_hidden = int(raw.get("target_hidden_size") or model.hidden_size)
        if target_hidden != target.hidden_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head {path!r} reads hidden states of size "
                             f"{target_hidden}, the target's are {target.hidden_size}")
        layers = _aux_layers(raw, target.num_hidden_layers)
        return cls(model, int(raw.get("draft_vocab_size") or model.vocab_size), layers, target_hidden,
                   bool(raw.get("norm_before_residual", False)))


def _aux_layers(raw: dict[str, object], num_layers: int) -> tuple[int, ...]:
    """The config's ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``), else
    vLLM's default (2, L // 2, L - 3); three distinct layers of the target."""
    eagle = raw.get("eagle_config")
    given = raw.get("eagle_aux_hidden_state_layer_ids")
    if given is None and isinstance(eagle, dict):
        given = eagle.get("eagle_aux_hidden_state_layer_ids")
    layers = list(given) if isinstance(given, list) else [2, num_layers // 2, num_layers - 3]
    if len(set(layers)) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in layers):
        raise ValueError(f"speculative_config: EAGLE-3 fuses three distinct layers of the target's {num_layers}, "
                         f"got {layers} (set eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return tuple(sorted(layers))


class Eagle3Layer(nn.Module):
    """The head's decoder layer: a Llama layer whose q, k and v read the embedding and the hidden
    state side by side, each normed by its own norm (``input_layernorm``, ``hidden_norm``)."""

    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(mc)
        self.self_attn.qkv_proj = nn.Linear(2 * mc.hidden_size, mc.q_size + 2 * mc.kv_size, bias=mc.attention_bias)
        self.mlp = MLP(mc)
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.hidden_norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)


class Eagle3Head(nn.Module):
    """The head's weights under the checkpoint's names (``midlayer.*``, ``fc``, ``norm``,
    ``lm_head``, ``d2t``; ``embed_tokens`` only when the checkpoint has it)."""

    def __init__(self, config: Eagle3Config, own_embedding: bool) -> None:
        super().__init__()
        mc = config.model
        self.config = config
        self.fc = nn.Linear(len(config.aux_layers) * config.target_hidden_size, mc.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(mc)
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.lm_head = nn.Linear(mc.hidden_size, config.draft_vocab_size, bias=False)
        self.d2t = nn.Parameter(torch.zeros(config.draft_vocab_size, dtype=torch.long), requires_grad=False)
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size) if own_embedding else None
        self._rope: RotaryFrequencies | None = None  # built on first use (not on the meta device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend) -> tuple[torch.Tensor, ...]:
        """embeds, hidden: [T, hidden]; returns (final-norm output, pre-norm output), each [T, hidden]."""
        layer, eps = self.midlayer, self.config.model.rms_norm_eps
        if self._rope is None or self._rope.inv_freq.device != positions.device:
            self._rope = rope_frequencies(self.config.model).to(positions.device)
        cos, sin = rope_cos_sin(positions, self._rope)
        e = rms_norm(embeds, layer.input_layernorm.weight, eps)[0]
        h = rms_norm(hidden, layer.hidden_norm.weight, eps)[0]
        residual = h if self.config.norm_before_residual else hidden
        attn = layer.self_attn(torch.cat((e, h), dim=-1), cos, sin, meta, kv_cache, backend)
        h, residual = rms_norm(attn, layer.post_attention_layernorm.weight, eps, residual)
        normed, prenorm = rms_norm(layer.mlp(h), self.norm.weight, eps, residual)
        return normed, prenorm

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row, in the target's vocabulary."""
        draft = linear(normed, self.lm_head).argmax(dim=-1)
        return draft + self.d2t.index_select(0, draft)

    def load(self, path: str) -> None:
        """The checkpoint's tensors copied in (``layers.0.`` read as ``midlayer.``; ``t2d`` unused;
        no ``d2t``: the draft vocabulary is the target's); missing or unexpected names raise."""
        params = dict(self.named_parameters())
        given: set[str] = set()
        with torch.no_grad():
            for name, tensor in load_hf_state_dict(path).items():
                name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
                if name == "t2d":
                    continue
                target, rows = name, slice(None)
                module, _, leaf = name.rpartition(".")
                part = _MERGED.get(module.rpartition(".")[2])
                if part is not None:
                    merged, index = part
                    target = f"{module.rpartition('.')[0]}.{merged}.{leaf}"
                    rows = self._rows(merged, index)
                if target not in params:
                    raise ValueError(f"EAGLE-3 head {path!r}: unexpected tensor {name!r}")
                destination = params[target][rows]
                if tuple(tensor.shape) != tuple(destination.shape):
                    raise ValueError(f"EAGLE-3 head {path!r}: {name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(destination.shape)}")
                destination.copy_(tensor)
                given.add(name)
        expected = set(_checkpoint_names(self))
        if self.config.draft_vocab_size == self.config.model.vocab_size:
            expected.discard("d2t")  # the identity
        elif "d2t" not in given:
            raise ValueError(f"EAGLE-3 head {path!r}: draft_vocab_size {self.config.draft_vocab_size} needs 'd2t'")
        missing = sorted(expected - given)
        if missing:
            raise ValueError(f"EAGLE-3 head {path!r}: missing tensors {missing[:8]}")

    def _rows(self, merged: str, index: int) -> slice:
        mc = self.config.model
        bounds = [0, mc.q_size, mc.q_size + mc.kv_size, mc.q_size + 2 * mc.kv_size] if merged == "qkv_proj" \
            else [0, mc.intermediate_size, 2 * mc.intermediate_size]
        return slice(bounds[index], bounds[index + 1])


def _checkpoint_names(head: Eagle3Head) -> list[str]:
    """The head's parameters under the checkpoint's names (merged ones by their parts)."""
    parts = {merged: [p for p, (m, _) in _MERGED.items() if m == merged] for merged, _ in _MERGED.values()}
    names: list[str] = []
    for name, _ in head.named_parameters():
        module, _, leaf = name.rpartition(".")
        prefix, _, last = module.rpartition(".")
        if last in parts:
            names.extend(f"{prefix}.{part}.{leaf}" for part in parts[last])
        else:
            names.append(name)
    return names


def has_own_embedding(path: str) -> bool:
    """Whether the head's checkpoint carries its own ``embed_tokens`` (else it shares the target's)."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as handle:
            if any(key.endswith("embed_tokens.weight") for key in handle.keys()):  # noqa: SIM118  # not a dict
                return True
    return False


class AuxHiddenStates:
    """The target's hook (``CausalLM.aux_hidden``): the residual stream entering ``layers``, fused
    by ``fc`` and stored at each token's slot in ``fused`` (its last row takes padded rows' slot -1)."""

    def __init__(self, layers: tuple[int, ...], fc: nn.Linear) -> None:
        self.layers = frozenset(layers)
        self.fc = fc
        self.fused: torch.Tensor | None = None  # [slots + 1, hidden], once the pool is sized
        self._taken: list[torch.Tensor] = []

    def take(self, index: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        if index in self.layers:
            self._taken.append(x if residual is None else x + residual)

    def store(self, slot_mapping: torch.Tensor) -> None:
        taken, self._taken = self._taken, []
        fused = linear(torch.cat(taken, dim=-1), self.fc)
        if self.fused is not None:  # (the profiling pass runs before: its activations counted)
            slots = torch.where(slot_mapping < 0, self.fused.shape[0] - 1, slot_mapping)
            self.fused.index_copy_(0, slots, fused)
