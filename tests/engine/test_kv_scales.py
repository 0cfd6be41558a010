"""fp8 KV scales from a checkpoint: found under each tool's names, refused when partial or broken, and
used by the pool, where they keep values past fp8's range from being clamped."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.local_redis import free_port
from engine.config import ConfigError, EngineConfig
from engine.kv_scales import KVScaleError, check_scale_names, read_kv_scales, scale_targets
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model, weight_files
from engine.sequence import SamplingParams
from tests.engine.conftest import DEVICE

PROMPT = [5, 17, 42, 99, 3, 250, 8, 61, 77, 12, 150, 33, 201, 4, 90, 120, 7, 65, 66, 67]
BIG = 1000.0  # K and V a thousand times larger than the model's own: far past fp8 e4m3's 448


def test_each_tools_names_map_to_a_layer_and_k_or_v():
    assert scale_targets("model.layers.3.self_attn.k_scale") == (3, "k")
    assert scale_targets("model.layers.3.self_attn.v_scale") == (3, "v")
    assert scale_targets("model.layers.0.self_attn.kv_scale") == (0, "kv")  # one for both (older AutoFP8)
    assert scale_targets("model.layers.12.self_attn.k_proj.output_scale") == (12, "k")
    assert scale_targets("model.layers.12.self_attn.v_proj.v_scale") == (12, "v")  # ModelOpt's
    assert scale_targets("layers.1.self_attn.k_scale") == (1, "k")  # a base model's, without model.
    assert scale_targets("model.layers.2.self_attn.qkv_proj.v_scale") == (2, "v")  # a fused projection's (Phi-3)
    assert scale_targets("model.layers.2.self_attn.k_proj.kv_scale") == (2, "k")  # on k_proj: K's only
    for other in ("model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.o_proj.output_scale",
                  "model.layers.3.mlp.k_scale", "model.layers.3.self_attn.q_proj.weight_scale",
                  "model.layers.3.self_attn.qkv_proj.output_scale"):
        assert scale_targets(other) is None, other
    check_scale_names({"model.layers.0.self_attn.kv_scale", "model.layers.1.self_attn.kv_scale"}, 2)
    check_scale_names({"model.embed_tokens.weight"}, 2)  # none at all: fine
    with pytest.raises(KVScaleError, match="V scales for 0 of 2 layers"):
        check_scale_names({"model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.k_scale"}, 2)
    with pytest.raises(KVScaleError, match="none for layer 1"):
        check_scale_names({"model.layers.0.self_attn.kv_scale"}, 2)


def _scaled_copy(src: str, dst, scales: dict[str, torch.Tensor] | None):
    """The model with K and V ``BIG`` times larger and Q and the output projection as much smaller: the
    same function (RoPE and attention are linear in them), but K/V values an fp8 pool must scale."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    for name in list(weights):
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            weights[name] = weights[name] * BIG
        elif ".self_attn.q_proj." in name or ".self_attn.o_proj." in name:
            weights[name] = weights[name] / BIG
    save_file({**weights, **(scales or {})}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _first_logits(path, kv_dtype: str) -> tuple[LLMEngine, torch.Tensor]:
    eng = LLMEngine(EngineConfig(model_id=str(path), max_batch_total_tokens=1024, kv_cache_dtype=kv_dtype),
                    loaded=load_model(str(path), device=DEVICE, dtype="float32"))
    eng.capture_logits = {}
    eng.generate([PROMPT], SamplingParams(max_new_tokens=1, ignore_eos=True))
    return eng, next(iter(eng.capture_logits.values()))[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / a.norm()).item()


def test_checkpoint_scales_keep_large_kv_values_in_an_fp8_pool(model_dir, tmp_path):
    per_layer = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(BIG) for i in range(2) for w in "kv"}
    plain = _scaled_copy(model_dir("tiny"), tmp_path / "plain", None)
    scaled = _scaled_copy(model_dir("tiny"), tmp_path / "scaled", per_layer)
    _, ref = _first_logits(plain, "float32")
    clamped_eng, clamped = _first_logits(plain, "fp8_e4m3fn")
    eng, kept = _first_logits(scaled, "fp8_e4m3fn")
    _, own = _first_logits(model_dir("tiny"), "fp8_e4m3fn")  # the model as written, scale 1.0
    _, own_ref = _first_logits(model_dir("tiny"), "float32")
    assert clamped_eng.kv_scales == "1.0" and eng.kv_scales == "checkpoint"
    assert eng.pool.k_scale.tolist() == [BIG, BIG] and eng.pool.v_scale.tolist() == [BIG, BIG]
    print(f"relative error vs float32 KV: clamped {_rel(ref, clamped):.3f}, scaled {_rel(ref, kept):.3f}, "
          f"unscaled model {_rel(own_ref, own):.3f}")
    assert _rel(ref, clamped) > 0.5  # clamped at 448: the model is broken
    assert _rel(ref, kept) < 0.2  # as close as the unscaled model with scale 1.0 (0.080 measured)
    assert abs(_rel(ref, kept) - _rel(own_ref, own)) < 0.02
    # a float pool ignores them; the checkpoint loads (transformers leaves the scales out)
    float_eng, _ = _first_logits(scaled, "bfloat16")
    assert float_eng.kv_scales == "1.0" and float_eng.pool.fp8_dtype is None


def test_partial_or_broken_scales_are_refused_by_an_fp8_pool_only(model_dir, tmp_path):
    partial = _scaled_copy(model_dir("tiny"), tmp_path / "partial", {"model.layers.0.self_attn.kv_scale": torch.tensor(2.0)})
    with pytest.raises(ConfigError, match="for 1 of 2 layers"):
        _first_logits(partial, "fp8_e4m3fn")
    eng, _ = _first_logits(partial, "float32")  # scales it does not use do not stop a float pool
    assert eng.kv_scales == "1.0"
    broken = {f"model.layers.{i}.self_attn.k_proj.output_scale": torch.tensor(float("nan")) for i in range(2)}
    broken |= {f"model.layers.{i}.self_attn.v_proj.output_scale": torch.tensor([1.0, 3.0]) for i in range(2)}
    nan = _scaled_copy(model_dir("tiny"), tmp_path / "nan", broken)
    with pytest.raises(KVScaleError, match="must be a positive number"):
        read_kv_scales(weight_files(nan), 2)
    with pytest.raises(ConfigError, match="k_proj.output_scale is nan"):
        _first_logits(nan, "fp8_e5m2")
    per_head = _scaled_copy(model_dir("tiny"), tmp_path / "per_head", {
        f"model.layers.{i}.self_attn.{w}_proj.output_scale": torch.tensor([1.0, 3.0 + i]) for i in range(2) for w in "kv"})
    assert read_kv_scales(weight_files(per_head), 2) == ([3.0, 4.0], [3.0, 4.0])  # a head's largest: none clamped


def test_scales_come_from_the_shards_the_index_names(model_dir, tmp_path):
    """A file beside the shards (an older revision's) is not read, as transformers does not load it."""
    sharded = _scaled_copy(model_dir("tiny"), tmp_path / "sharded", None)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    scales = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(BIG) for i in range(2) for w in "kv"}
    halves = [dict(list(weights.items())[: len(weights) // 2]), {**dict(list(weights.items())[len(weights) // 2:]), **scales}]
    index = {"metadata": {}, "weight_map": {}}
    for n, part in enumerate(halves, 1):
        name = f"model-0000{n}-of-00002.safetensors"
        save_file(part, str(sharded / name), metadata={"format": "pt"})
        index["weight_map"] |= {k: name for k in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor(7.0)}, str(sharded / "old-model.safetensors"))
    assert read_kv_scales(weight_files(sharded), 2) == ([BIG, BIG], [BIG, BIG])
    eng, _ = _first_logits(sharded, "fp8_e4m3fn")
    assert eng.kv_scales == "checkpoint"


def test_radixserve_serve_refuses_broken_scales_before_starting(model_dir, tmp_path):
    from app.cli import preflight
    from app.config import Settings

    partial = _scaled_copy(model_dir("tiny"), tmp_path / "partial", {"model.layers.1.self_attn.k_scale": torch.tensor(2.0)})
    fp8 = Settings(model_id=str(partial), kv_cache_dtype="fp8_e4m3fn", port=free_port())  # (a free port: the check passes)
    assert "K scales for 1 of 2 layers" in preflight(fp8, True)
    assert preflight(Settings(model_id=str(partial), port=free_port()), True) is None  # a float pool does not read them
