"""Load a transformers causal LM and its tokenizer from a local folder (never from a hub)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model id that is not a folder must fail, not download

log = logging.getLogger(__name__)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    config: object
    model_id: str
    device: torch.device
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads or self.config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    @property
    def sliding_window(self) -> int | None:
        cfg = self.config
        window = getattr(cfg, "sliding_window", None)
        if window is None or getattr(cfg, "use_sliding_window", True) is False:
            return None
        types = getattr(cfg, "layer_types", None)
        if types and "sliding_attention" not in types:
            return None
        return int(window)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def check_model_folder(model_id: str):
    """``(path, config, tokenizer)`` of a local model folder, without its weights (cheap enough for the
    command line to check before it starts anything); ``ModelLoadError`` names what is wrong."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(model_id).expanduser()
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise ModelLoadError(f"model folder {model_id!r} {what} (RadixServe loads local folders only; "
                             "create one with `radixserve init-model PATH`)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a transformers model folder")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's broken folder
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e
    return path, config, tokenizer


def model_context(config) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings``), if it says."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def load_model(model_id: str, device: str = "auto", dtype: str = "auto",
               attn_implementation: str | None = None) -> LoadedModel:
    """Load from a local folder with ``config.json``, safetensors weights and a tokenizer."""
    from transformers import AutoModelForCausalLM

    path, config, tokenizer = check_model_folder(model_id)
    if config.model_type not in SUPPORTED:
        log.warning("model type %r is not one of the tested architectures %s", config.model_type, SUPPORTED)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dt, attn_implementation=attn_implementation)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load weights from {path}: {e}") from e
    model.to(dev).eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, config, str(path), dev, dt)
