from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model

# bench/gpu_check.sh sets cuda: the same tests then run the engine on the GPU (float32, to compare)
DEVICE = os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The plain transformers model (SDPA, its own KV cache; eager for Gemma 2, whose soft-capped scores
    SDPA cannot compute): the reference."""
    from transformers import AutoModelForCausalLM

    made = {}

    def get(preset: str):
        if preset not in made:
            made[preset] = AutoModelForCausalLM.from_pretrained(
                model_dir(preset), attn_implementation="eager" if preset == "tiny-gemma2" else "sdpa", use_kernels=False
            ).to(DEVICE).eval()
        return made[preset]

    return get


@pytest.fixture(scope="session")
def loaded(model_dir):
    made = {}

    def get(preset: str):
        if preset not in made:
            made[preset] = load_model(model_dir(preset), device=DEVICE, dtype="float32")
        return made[preset]

    return get


@pytest.fixture
def make_engine(loaded):
    engines = []

    def make(preset: str = "tiny", **kw) -> LLMEngine:
        m = loaded(preset)
        cfg = EngineConfig(model_id=m.model_id, **{"max_batch_total_tokens": 4096, **kw})
        eng = LLMEngine(cfg, loaded=m)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:  # nothing lost: every block is free or cached once requests are done
        if not eng.has_work():
            eng.check_invariants()
            assert eng.kv.allocator.num_in_use == 0


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():  # (the mask given: without it, transformers takes every id 0 for padding)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([x[0] for x in out.logits]).float().cpu()
