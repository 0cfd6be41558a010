"""What the engine refuses to serve, and why: architectures it would compute wrongly, broken weight
folders, pools that cannot hold one request or cannot be allocated, devices this torch lacks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from app.local_redis import free_port
from engine.attention import paged_attention
from engine.config import ConfigError, EngineConfig, request_limits
from engine.model_loader import ModelLoadError, check_model_folder, load_model, resolve_device
from engine.model_support import (
    UnsupportedModel,
    layer_windows,
    rope_type,
    serving_limits,
    sliding_window,
    unsupported,
)

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def test_every_supported_architecture_has_a_preset_the_tests_check():
    from engine.model_support import SUPPORTED
    from engine.presets import PRESETS
    from tests.engine.test_hf_equivalence import CHECKED

    assert {PRESETS[p]["architecture"] for p in CHECKED} == set(SUPPORTED)


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox", "falcon", "gpt_oss"])
def test_architectures_it_cannot_compute_are_refused(kind):
    assert "not supported" in unsupported(AutoConfig.for_model(kind))


def test_windows_are_read_per_layer_and_unknown_layer_kinds_are_refused():
    mixed = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1, **SMALL)
    assert unsupported(mixed) is None
    assert layer_windows(mixed, 2) == (None, 16) and sliding_window(mixed) is None  # its full layer reads all
    every = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0, **SMALL)
    assert unsupported(every) is None and sliding_window(every) == 16 and layer_windows(every, 2) == (16, 16)
    off = AutoConfig.for_model("qwen2", use_sliding_window=False, sliding_window=16, **SMALL)
    assert unsupported(off) is None and sliding_window(off) is None and layer_windows(off, 2) == (None, None)
    mistral = AutoConfig.for_model("mistral", sliding_window=16, **SMALL)
    assert unsupported(mistral) is None and layer_windows(mistral, 2) == (16, 16)
    chunked = AutoConfig.for_model("gemma3_text", sliding_window=16, layer_types=["chunked_attention"] * 2, **SMALL)
    assert "chunked_attention" in unsupported(chunked)
    both_ways = AutoConfig.for_model("gemma3_text", use_bidirectional_attention=True, **SMALL)
    assert "bidirectional" in unsupported(both_ways)


def test_rope_scaling_is_found_per_layer_kind():
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    gemma3 = AutoConfig.for_model("gemma3_text", sliding_window=16, rope_parameters=rope, **SMALL)
    assert rope_type(gemma3) == "linear" and unsupported(gemma3) is None
    assert rope_type(AutoConfig.for_model("gemma3_text", **SMALL)) is None


def test_batch_dependent_rope_is_refused():
    assert unsupported(AutoConfig.for_model("llama", **SMALL), 4096) is None
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 32}
    cfg = AutoConfig.for_model("llama", rope_scaling=rope, **SMALL)
    assert "at most 32" in unsupported(cfg, 64)
    assert unsupported(cfg, 32) is None  # never past the switch: the short factors, whatever the batch
    assert unsupported(cfg, None) is None and serving_limits(cfg, None, None, None) == (31, 32)  # the default
    with pytest.raises(UnsupportedModel, match="at most 32"):
        serving_limits(cfg, None, 64, None)


def test_the_attention_never_drops_an_argument_it_does_not_implement():
    with pytest.raises(NotImplementedError, match="s_aux"):
        paged_attention(None, None, None, None, None, paged_batch=object(), s_aux=torch.zeros(4))


@pytest.fixture
def tiny_folder(tmp_path):
    from engine.model_init import write_model

    return write_model(tmp_path / "m", "tiny")


def test_broken_weight_files_are_refused_before_loading(tiny_folder):
    weights = tiny_folder / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(weights).items()}  # not views of the file we rewrite
    weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        check_model_folder(str(tiny_folder))
    # a sharded checkpoint whose index names a shard that is not there
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:5]}, tiny_folder / "model-00001-of-00002.safetensors")
    weights.unlink()
    index = {"metadata": {}, "weight_map": {k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors"
                                            for i, k in enumerate(names)}}
    (tiny_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="lacks 1 weight file"):
        check_model_folder(str(tiny_folder))


def test_a_single_weights_file_wins_over_a_stale_shard_index_as_in_transformers(tiny_folder):
    # a folder saved sharded, then saved whole: transformers deletes the old shards but leaves their index,
    # and loads model.safetensors; the index was read first here, and the folder refused
    from engine.model_loader import weight_files

    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tiny_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_files(tiny_folder) == [tiny_folder / "model.safetensors"]
    check_model_folder(str(tiny_folder))
    # weights transformers does not load (Mistral's native file, shards without their index): refused up
    # front (they passed, and every replica failed in from_pretrained)
    (tiny_folder / "model.safetensors.index.json").unlink()
    (tiny_folder / "model.safetensors").rename(tiny_folder / "consolidated.safetensors")
    with pytest.raises(ModelLoadError, match="neither model.safetensors nor .*found consolidated.safetensors .*Mistral"):
        check_model_folder(str(tiny_folder))


def test_a_model_folder_given_as_dot_is_served_under_its_own_name(tiny_folder, monkeypatch):
    from app.config import Settings

    monkeypatch.chdir(tiny_folder)
    assert Settings(model_id=".").model_name() == Settings(model_id="./").model_name() == "m"  # was ""


def test_a_checkpoint_missing_tensors_is_refused_not_filled_with_random_values(tiny_folder):
    weights = tiny_folder / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(weights).items()}  # not views of the file we rewrite
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lack 9 of the model's tensors"):
        check_model_folder(str(tiny_folder))  # the command line's check, from the headers alone
    with pytest.raises(ModelLoadError, match="lack 9 of the model's tensors"):
        load_model(str(tiny_folder))


def test_a_mixtures_experts_are_checked_as_transformers_stacks_them(tmp_path):
    # a Mixtral checkpoint names each expert's matrices (w1, w2, w3 under block_sparse_moe), which
    # transformers renames and stacks into one tensor per layer: those names are what it loads from
    from engine.model_init import write_model

    folder = write_model(tmp_path / "m", "tiny-mixtral")
    weights = folder / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(weights).items()}
    assert any(".block_sparse_moe.experts.0.w1." in k for k in tensors)
    check_model_folder(str(folder))
    save_file({k: v for k, v in tensors.items() if ".layers.1.block_sparse_moe.gate." not in k}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lack 1 of the model's tensors \(e.g. model.layers.1.mlp.gate"):
        check_model_folder(str(folder))
    # the stacked experts are the load's to check: one expert's matrices missing, it reports them
    save_file({k: v for k, v in tensors.items() if ".layers.1.block_sparse_moe.experts." not in k}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lack 2 of the model's tensors \(e.g. model.layers.1.mlp.experts"):
        load_model(str(folder))


def test_tensor_names_are_checked_from_the_headers_as_transformers_would_load_them(tiny_folder):
    weights = tiny_folder / "model.safetensors"
    tensors = {k: v.clone() for k, v in load_file(weights).items()}
    reference = load_model(str(tiny_folder)).model.state_dict()
    # a base model's names (no "model." prefix) load the same: accepted
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    check_model_folder(str(tiny_folder))
    loaded = load_model(str(tiny_folder)).model.state_dict()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    # another architecture's layout: refused before any weight is read, naming what it lacks
    save_file({k.replace("model.layers.", "transformer.h."): v for k, v in tensors.items()}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lack 18 of the model's tensors \(e.g. model.layers.0."):
        check_model_folder(str(tiny_folder))
    # a quantized checkpoint packs its tensors under other names: refused by serving_limits (it passed,
    # and every replica then failed in transformers, without the method's kernels)
    config = json.loads((tiny_folder / "config.json").read_text())
    (tiny_folder / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}}))
    _, quantized, _ = check_model_folder(str(tiny_folder))
    with pytest.raises(UnsupportedModel, match=r"quantized weights \(quantization_config: awq\)"):
        serving_limits(quantized, None, None, 4096)
    # one that only names fp8 KV-cache scales (llm-compressor's kv_cache_scheme) has plain weights
    quantized.quantization_config = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    serving_limits(quantized, None, None, 4096)
    # but sparse or transformed weights beside the KV scheme are not plain (they loaded as if they were)
    for scheme in ("sparsity_config", "transform_config"):
        quantized.quantization_config = {"quant_method": "compressed-tensors", scheme: {"format": "x"},
                                         "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
        with pytest.raises(UnsupportedModel, match="quantized weights"):
            serving_limits(quantized, None, None, 4096)
    (tiny_folder / "config.json").write_text(json.dumps(config))
    # tensors the model has no place for (a config that leaves out what the weights have) are refused;
    # fp8 KV scales are the engine's own to read
    scales = {f"model.layers.{i}.self_attn.{k}": torch.tensor(1.0) for i in range(config["num_hidden_layers"])
              for k in ("k_scale", "v_scale")}
    save_file({**tensors, **scales}, weights, metadata={"format": "pt"})
    load_model(str(tiny_folder))
    # and so declared in config.json, as llm-compressor writes it: it loads (transformers asked for the
    # compressed-tensors package, which it only needs for quantized weights, in every replica)
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {},
               "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    (tiny_folder / "config.json").write_text(json.dumps({**config, "quantization_config": kv_only}))
    assert load_model(str(tiny_folder)).config.quantization_config["kv_cache_scheme"]["num_bits"] == 8
    (tiny_folder / "config.json").write_text(json.dumps(config))
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(4)}, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="1 tensors the model has no place for .e.g. model.layers.0.self_attn.q_proj.bias"):
        load_model(str(tiny_folder))
    save_file(tensors, weights, metadata={"format": "pt"})
    # a tied output layer needs no tensor of its own
    (tiny_folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, weights, metadata={"format": "pt"})
    check_model_folder(str(tiny_folder))


def test_a_folder_without_tokenizer_gets_one_line(tiny_folder):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_folder / f).unlink()
    with pytest.raises(ModelLoadError) as e:
        check_model_folder(str(tiny_folder))
    assert "has no tokenizer" in str(e.value) and "\n" not in str(e.value)


def test_limits_follow_the_pool_unless_set_and_then_must_fit_it():
    assert request_limits(None, None, 4096, 512) == (511, 512)  # one request fills the pool at most
    assert request_limits(None, None, 4096, None) == (4095, 4096)  # pool sized from memory: the context
    with pytest.raises(ConfigError, match="more than the KV pool holds"):
        request_limits(None, 1024, 4096, 512)
    with pytest.raises(ConfigError, match="the KV pool's size"):
        request_limits(600, None, 4096, 512)
    for window in (None, 256):  # a sliding window frees blocks as it slides, but a request starts whole
        with pytest.raises(ConfigError, match="KV pool holds"):
            EngineConfig(model_id="x", max_batch_total_tokens=512, max_total_tokens=1024, window_size=window).validate()
    with pytest.raises(ConfigError, match=r"KV pool holds \(4992 tokens"):  # whole blocks: 4992
        EngineConfig(model_id="x", max_batch_total_tokens=5000, max_total_tokens=5000).validate()
    # the settings alone say nothing of a long input: the model's context decides at load
    EngineConfig(model_id="x", max_input_tokens=8000).validate()


def test_the_engine_takes_its_limits_from_a_small_pool_and_refuses_one_it_cannot_allocate(make_engine):
    eng = make_engine("tiny", max_batch_total_tokens=512)
    assert (eng.max_input_tokens, eng.max_total_tokens) == (511, 512)
    with pytest.raises(ConfigError, match="GiB free"):
        make_engine("tiny", max_batch_total_tokens=10**12)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_a_device_this_torch_cannot_use_is_refused():
    with pytest.raises(ModelLoadError, match="MPS is not available"):
        resolve_device("mps")


def test_preflight_refuses_what_the_replicas_could_not_serve(tmp_path, tiny_folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    from app.cli import preflight
    from app.config import Settings
    from engine.model_init import build_tokenizer

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=320)).save_pretrained(gpt2)
    build_tokenizer(320).save_pretrained(gpt2)
    assert "model type 'gpt2' is not supported" in preflight(Settings(model_id=str(gpt2), port=free_port()), local_ray=True)
    small = Settings(model_id=str(tiny_folder), port=free_port(), max_batch_total_tokens=512, max_total_tokens=1024)
    assert "KV pool holds" in preflight(small, local_ray=True)
    # on the CPU: a GPU's pool is the replica's to check (the CLI holds no CUDA context)
    huge = Settings(model_id=str(tiny_folder), port=free_port(), max_batch_total_tokens=10**12, device="cpu")
    assert "GiB free" in preflight(huge, local_ray=True)
    assert preflight(Settings(model_id=str(tiny_folder), port=free_port(), max_batch_total_tokens=512), local_ray=True) is None
    # GPUs the replicas starting at once cannot find here: Ray left them pending and the start-up waited for good
    import torch

    have = torch.cuda.device_count()
    many = Settings(model_id=str(tiny_folder), port=free_port(), max_batch_total_tokens=512, num_replicas=have + 1,
                    replica_num_gpus=1)
    assert f"{have + 1} replica(s) x --replica-num-gpus 1 do not fit on this machine's {have} GPU(s)" in \
        preflight(many, local_ray=True)
    assert preflight(many, local_ray=False) is None  # a cluster's GPUs are its nodes'


def test_the_start_up_check_counts_a_pool_for_each_replica_starting_here(tiny_folder, monkeypatch):
    # a local Ray starts every replica on this machine, each allocating its own pool: 8 replicas of a
    # pool that fit once passed the check, then overcommitted the machine's memory
    import cache.kv_pool as kv_pool
    from app.cli import preflight
    from app.config import Settings

    monkeypatch.setattr(kv_pool, "available_memory", lambda device: 10 * 2**30)
    cpu = torch.device("cpu")
    blocks = 4 * 2**30 // (16 * 1024) - kv_pool.PAD_BLOCKS  # 4 GiB at 1 KiB a token
    assert kv_pool.pool_problem(blocks, 16, 1024, cpu) is None
    assert kv_pool.pool_problem(blocks, 16, 1024, cpu, replicas=2) is None
    assert "needs 4.0 GiB (3 replicas start here, one pool each: 12.0 GiB), more than the 10.0 GiB free" in \
        kv_pool.pool_problem(blocks, 16, 1024, cpu, replicas=3)
    asked = []
    monkeypatch.setattr(kv_pool, "pool_problem", lambda *a, **k: asked.append(k["replicas"]))
    for replicas in (1, 3):
        preflight(Settings(model_id=str(tiny_folder), port=free_port(), max_batch_total_tokens=512, device="cpu",
                           num_replicas=replicas), local_ray=True)
    assert asked == [1, 3]


def test_replicas_on_cuda_take_their_share_of_the_gpus_and_see_only_theirs(monkeypatch, tiny_folder, capsys):
    # with --replica-num-gpus 0 Ray neither counted a GPU for them nor hid the others: all ran on cuda:0
    import torch

    from app.cli import _share_gpus, preflight
    from app.config import Settings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    one = Settings(model_id=str(tiny_folder), port=free_port(), max_batch_total_tokens=512)
    assert _share_gpus(one).replica_num_gpus == 1 and "takes 1 GPU" in capsys.readouterr().err
    assert _share_gpus(one.model_copy(update={"num_replicas": 4})).replica_num_gpus == 0.5
    # Ray puts a fraction of a GPU on one GPU: 2 GPUs x 0.67 held two replicas of three, and start-up waited
    assert _share_gpus(one.model_copy(update={"num_replicas": 3})).replica_num_gpus == 0.5
    scaled = Settings.from_sources(cli={"model_id": str(tiny_folder), "autoscaling": {"min_replicas": 0, "max_replicas": 5}},
                                   env={})
    assert _share_gpus(scaled).replica_num_gpus == 1 / 3  # as many as autoscaling may run (a local Ray adds no GPU)
    from app.cli import gpus_hold

    for replicas, per, gpus, holds in ((3, 2 / 3, 2, False), (2, 2 / 3, 2, True), (6, 1 / 3, 2, True), (7, 1 / 3, 2, False),
                                       (4, 0.5, 2, True), (5, 0.5, 2, False), (1, 2, 2, True), (2, 1.5, 3, False),
                                       (9, 0, 1, True)):
        assert gpus_hold(replicas, per, gpus) == holds, (replicas, per, gpus)
    asked = Settings(model_id=str(tiny_folder), port=free_port(), replica_num_gpus=0)  # (said: kept, a shared GPU)
    assert _share_gpus(asked).replica_num_gpus == 0
    assert _share_gpus(Settings(model_id=str(tiny_folder), port=free_port(), device="cpu")).replica_num_gpus == 0
    # Ray shows each replica only its own GPUs, from cuda:0: cuda:1 was "invalid device ordinal" there
    for gpus, device, said in ((1, "cuda:1", "sees only its own 1 GPU(s)"), (0.5, "cuda:1", "sees only its own 1"),
                               (2, "cuda:1", None), (2, "cuda:0", None), (1, "cuda", None)):
        s = Settings(model_id=str(tiny_folder), port=free_port(), max_batch_total_tokens=512, replica_num_gpus=gpus,
                     device=device)
        problem = preflight(s, local_ray=True)
        assert (said in problem) if said else problem is None, (gpus, device, problem)


def test_auto_dtype_is_bf16_only_where_the_gpu_computes_it(monkeypatch):
    # torch.cuda.is_bf16_supported() says yes on pre-Ampere GPUs too (emulated): the capability decides
    import torch

    from engine.model_loader import resolve_dtype

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # V100, T4
    assert resolve_dtype("auto", cuda) == torch.float16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", cuda) == torch.bfloat16  # asked for: as asked


def test_weights_are_read_straight_onto_the_serving_device(tiny_folder, monkeypatch):
    """transformers places each tensor on the device as it reads it (a GPU replica holds no second copy
    of the weights in host memory); without accelerate the weights load on the CPU and move after, and
    serve the same."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    asked, load = [], AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        asked.append(kwargs.get("device_map"))
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    placed = load_model(str(tiny_folder), device="cpu").model.state_dict()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name, *a))
    moved = load_model(str(tiny_folder), device="cpu").model.state_dict()
    assert asked == [{"": torch.device("cpu")}, None]
    assert placed.keys() == moved.keys() and all(torch.equal(placed[k], moved[k]) for k in placed)


def test_no_layer_is_swapped_for_a_hub_kernel(tiny_folder, monkeypatch):
    """transformers (5.25 on) kernelizes a model by default when the `kernels` package is there, which on
    CUDA fetches layers from the Hub at load time: offline that fails the load (seen on an H200), and
    online the replica would serve code that is not the checkpoint's. The engine asks for none."""
    from transformers import PreTrainedModel

    asked, set_use = [], PreTrainedModel.set_use_kernels

    def spy(self, use_kernels, *args, **kwargs):
        asked.append(use_kernels)
        return set_use(self, use_kernels, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", spy)
    loaded = load_model(str(tiny_folder), device="cpu")
    assert asked == [False] and not loaded.model.use_kernels


def test_a_folder_whose_tokenizer_is_a_sentencepiece_model_alone_loads(tiny_folder, tmp_path):
    # Llama 2-era checkpoints ship tokenizer.model without tokenizer.json: transformers converts it with
    # the sentencepiece package, which the project did not depend on (the folder was refused, naming tiktoken)
    import sentencepiece as spm
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (tiny_folder / f).unlink(missing_ok=True)
    (tiny_folder / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    (tiny_folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    check_model_folder(str(tiny_folder))
    tok = AutoTokenizer.from_pretrained(tiny_folder)
    ids = tok("the lazy fox").input_ids
    assert tok.eos_token_id == 2 and tok.decode(ids, skip_special_tokens=True) == "the lazy fox"
