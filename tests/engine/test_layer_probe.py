"""Before it serves a model, the engine asks its layers what they ask of attention: a window other than
the one it read from config.json, or a layer that never comes through its paged attention, would serve
wrong tokens without an error, so those models are refused at start-up."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.layer_probe import probe_layers
from engine.llm_engine import LLMEngine
from engine.model_init import write_model
from engine.model_loader import load_model
from engine.model_support import UnsupportedModel


def _engine(folder, loaded=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_id=str(folder), max_batch_total_tokens=1024), loaded=loaded)


def test_each_layer_reports_its_own_window(tmp_path):
    from engine import attention

    folder = write_model(tmp_path / "g", "tiny-gemma3")  # sliding, sliding, full
    m = load_model(str(folder))
    m.model.set_attn_implementation(attention.register())
    asked = probe_layers(m.model, m.device)
    assert [asked[i]["sliding_window"] for i in range(3)] == [24, 24, None] == list(m.layer_windows)
    _engine(folder, m)  # and the engine takes it


def test_a_window_transformers_never_applies_is_refused(tmp_path):
    # a Llama config that carries a sliding_window: transformers' Llama attends to everything, the
    # engine would have slid
    folder = write_model(tmp_path / "m", "tiny")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 24}))
    with pytest.raises(UnsupportedModel, match="config.json sets a sliding window of 24 tokens that transformers' "
                                               "layer 0 does not pass to attention"):
        _engine(folder)
    # one as long as the context masks nothing: served (every replica refused Phi-3.5-MoE's 131072)
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": config["max_position_embeddings"]}))
    assert _engine(folder).window is None


def test_a_layer_that_attends_on_its_own_is_refused(tmp_path):
    folder = write_model(tmp_path / "m", "tiny")
    m = load_model(str(folder))
    layer = m.model.model.layers[1].self_attn

    def own_attention(hidden_states, *args, **kwargs):  # never reads or writes the paged KV cache
        return torch.zeros_like(hidden_states), None

    layer.forward = own_attention
    with pytest.raises(UnsupportedModel, match="1 of its 2 layers .e.g. layer 1. do not attend through"):
        _engine(folder, m)


def test_a_layer_without_grouped_heads_is_refused(tmp_path):
    folder = write_model(tmp_path / "m", "tiny")
    m = load_model(str(folder))
    del m.model.model.layers[0].self_attn.num_key_value_groups  # (GPT-NeoX's attention has none)
    with pytest.raises(UnsupportedModel, match="do not call attention the way the engine serves it .AttributeError"):
        _engine(folder, m)
