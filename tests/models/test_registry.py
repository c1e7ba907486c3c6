"""The model registry: architecture name -> the class that builds it, its error, its listings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_actors.cli import main
from vllm_actors.models import registry
from vllm_actors.models.config import ModelConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_every_entry_builds_a_class() -> None:
    names = [entry.architecture for entry in registry.entries()]
    assert len(names) == len(set(names)) and {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(names)
    for entry in registry.entries():
        cls = registry.model_class(entry.model_type)
        assert cls.__name__ == entry.class_name
        assert callable(getattr(cls, "load_from", None))


def test_resolve_prefers_architectures_then_model_type() -> None:
    assert registry.resolve({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}).model_type == "qwen3"
    assert registry.resolve({"model_type": "llama"}).architecture == "LlamaForCausalLM"
    # a known model_type behind an unknown class (a multimodal wrapper) is refused
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration"):
        registry.resolve({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llama"})


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "GptOssForCausalLM", "Qwen3NextForCausalLM"])
def test_unknown_architecture_names_the_supported_list(arch: str) -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf_config({"architectures": [arch], "model_type": "x", "vocab_size": 8})
    message = str(info.value)
    assert arch in message
    for supported in registry.supported_architectures():
        assert supported in message


def test_cli_lists_models_and_docs_hold_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    listed = capsys.readouterr().out
    for entry in registry.entries():
        assert re.search(rf"^{entry.architecture}\s+{entry.model_type}", listed, re.M)
    assert main(["models", "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table == registry.markdown_table()
    docs = DOCS.read_text()
    start = docs.index("<!-- registry table: vllm-actors models --markdown -->\n")
    end = docs.index("<!-- end registry table -->")
    assert docs[docs.index("\n", start) + 1 : end] == table, "regenerate docs/models.md's table"
