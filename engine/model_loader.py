"""Load a transformers causal LM and its tokenizer from a local folder (never from a hub)."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_scales import SCALE_NAME
from engine.model_support import (
    SUPPORTED,
    head_dim,
    kv_heads,
    layer_windows,
    quantizes_weights,
    sliding_window,
    unsupported_type,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model id that is not a folder must fail, not download

log = logging.getLogger(__name__)


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
        return kv_heads(self.config)

    @property
    def head_dim(self) -> int:
        return head_dim(self.config)

    @property
    def sliding_window(self) -> int | None:
        return sliding_window(self.config)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return layer_windows(self.config, self.num_layers)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    usable = {"cpu": lambda: True, "cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available,
              "xpu": getattr(getattr(torch, "xpu", None), "is_available", lambda: False)}
    if not usable.get(dev.type, lambda: True)():
        raise ModelLoadError(f"device {device!r}: {dev.type.upper()} is not available to this torch")
    return dev


def load_device_map(device: torch.device) -> dict[str, torch.device] | None:
    """Where ``from_pretrained`` puts each tensor as it reads it: on the serving device, so a GPU replica
    never holds a whole copy of the weights in host memory first (transformers does this through
    ``accelerate``; without it, None: the weights load on the CPU and move after)."""
    if importlib.util.find_spec("accelerate") is None:
        return None
    if device.type == "cuda" and device.index is None:  # (transformers wants the index)
        device = torch.device("cuda", torch.cuda.current_device())
    return {"": device}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":  # bf16 where the GPU computes it (Ampere on), else fp16; float32 on a CPU
        if device.type != "cuda":
            return torch.float32
        # (not is_bf16_supported(): by default it says yes where bf16 is only emulated, slowly)
        if torch.cuda.get_device_capability(device)[0] >= 8:
            return torch.bfloat16
        log.warning("this GPU has no bf16: the model runs in float16 (a model trained in bf16 may overflow; "
                    "--dtype float32 is the safe choice)")
        return torch.float16
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
    try:
        kind = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
    if kind not in SUPPORTED:  # before transformers, whose message for an unknown type suggests upgrading it
        raise ModelLoadError(unsupported_type(kind))
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's broken folder
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {_first_line(e)}") from e
    check_tensor_names(path, config, check_weight_files(path))
    if not any((path / name).is_file() for name in TOKENIZER_SOURCES):
        raise ModelLoadError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_SOURCES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {_first_line(e)}") from e
    return path, config, tokenizer


# the files that decide a model's token ids (whichever of them a tokenizer has; the service's cache
# namespace hashes them, and init-model --force clears them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "special_tokens_map.json", "added_tokens.json")
TOKENIZER_SOURCES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")  # (one at least)


def _first_line(e: Exception) -> str:
    """transformers' errors run to several lines of advice; the command line prints one."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def weight_files(path: Path) -> list[Path]:
    """The safetensors files transformers loads, in its order: ``model.safetensors`` when there is one (an
    index beside it, left by a sharded save before, is not read), else the shards the index names (a
    file beside them, from an older revision, is not read). Other files alone (Mistral's native
    ``consolidated.safetensors``, shards whose index is gone) transformers does not load: refused here, not
    in each replica."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no .safetensors weights")
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index: {e}") from e
        missing = sorted(name for name in shards if not (path / name).is_file())
        if missing:
            raise ModelLoadError(f"{path} lacks {len(missing)} weight file(s) its index names: {', '.join(missing[:3])}")
        files = [path / name for name in sorted(shards)]
    else:
        found = ", ".join(f.name for f in files[:3]) + (", ..." if len(files) > 3 else "")
        native = " (consolidated.safetensors is Mistral's own layout: take the repository's Hugging Face files)" \
            if any(f.name.startswith("consolidated") for f in files) else ""
        raise ModelLoadError(f"{path} has neither model.safetensors nor model.safetensors.index.json, which "
                             f"transformers loads; found {found}{native}")
    return files


def check_weight_files(path: Path) -> set[str]:
    """Every weight file the folder names is there and starts with a readable safetensors header
    (a shard left out of a download, or an empty file, fails here rather than in each replica); returns
    the tensor names the headers list."""
    names: set[str] = set()
    for f in weight_files(path):
        try:
            with f.open("rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                if size > f.stat().st_size - 8:
                    raise ValueError("the header is longer than the file")
                header = json.loads(fh.read(size))
            names.update(k for k in header if k != "__metadata__")
        except (OSError, ValueError, struct.error, TypeError) as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file (truncated or empty?): {e}") from e
    return names


def check_tensor_names(path: Path, config, names: set[str]) -> None:
    """The checkpoint names every parameter the model has (a checkpoint of another layout would load
    with random weights in their place, which ``load_model`` refuses after the replicas have spent
    their start-up on it). The model is built on the meta device: no memory, a second for any size.
    Only parameters count (buffers such as RoPE's are rebuilt), a tied one once, and a name may lack
    the base model's prefix, as transformers allows."""
    from transformers import AutoModelForCausalLM

    if getattr(config, "quantization_config", None):  # quantized weights: refused by model_support.unsupported;
        return  # fp8 KV scales only: the load decides
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - leave the verdict to the load itself
        log.warning("cannot check the tensor names of %s: %s", path, _first_line(e))
        return
    renames, made = _conversions(getattr(config, "model_type", None))
    for source, target in renames:
        names = {re.sub(source, target, n) for n in names}
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    have = names | {prefix + n for n in names}
    # a parameter transformers makes from several tensors (a mixture's experts, stacked) is left to the
    # load, which reports whatever it could not make
    missing = sorted(n for n, _ in model.named_parameters() if n not in have and not any(re.search(p, n) for p in made))
    if missing:
        raise ModelLoadError(_missing_message(path, missing))


def _conversions(model_type: str | None) -> tuple[list[tuple[str, str]], list[str]]:
    """What transformers does to a checkpoint's tensor names as it loads this model type: the renames
    (pattern, replacement) and the patterns of the parameters it makes from several tensors."""
    try:
        from transformers.conversion_mapping import WeightConverter, get_checkpoint_conversion_mapping
        steps = get_checkpoint_conversion_mapping(model_type) or ()
    except Exception:  # noqa: BLE001 - a transformers without conversions renames nothing
        return [], []
    renames: list[tuple[str, str]] = []
    made: list[str] = []
    for step in steps:
        sources, targets = list(getattr(step, "source_patterns", ())), list(getattr(step, "target_patterns", ()))
        if isinstance(step, WeightConverter) or len(sources) != 1 or len(targets) != 1:
            made.extend(re.escape(t) for t in targets)
        else:
            renames.append((sources[0], targets[0]))
    return renames, made


def _missing_message(path: Path, missing: list[str]) -> str:
    return (f"the weights in {path} lack {len(missing)} of the model's tensors (e.g. {', '.join(missing[:3])}): "
            "a partial or mismatched checkpoint")


def _plain_weights_config(config):
    """``config`` as transformers is to load the weights: a quantization_config that names only fp8 KV-cache
    scales (llm-compressor's ``kv_cache_scheme``) left out, as the weights are plain and the engine reads
    the scales itself; kept, it had transformers ask for the compressed-tensors package, which it lacks."""
    quant = getattr(config, "quantization_config", None)
    if quant is None or quantizes_weights(quant):
        return config
    plain = copy.deepcopy(config)
    del plain.quantization_config
    return plain


def load_model(model_id: str, device: str = "auto", dtype: str = "auto",
               attn_implementation: str | None = None) -> LoadedModel:
    """Load from a local folder with ``config.json``, safetensors weights and a tokenizer."""
    from transformers import AutoModelForCausalLM

    path, config, tokenizer = check_model_folder(model_id)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        # use_kernels=False: with the `kernels` package installed (transformers 5.25 requires it), transformers
        # swaps layers for kernels fetched from the Hub on CUDA by default: a download at load time, which
        # fails offline, and layers that are not the checkpoint's own code
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=_plain_weights_config(config), local_files_only=True, dtype=dt,
            attn_implementation=attn_implementation, output_loading_info=True, device_map=load_device_map(dev),
            use_kernels=False)
        missing = sorted(info.get("missing_keys") or ())
        if missing:  # transformers would fill them with random values and serve that
            raise ModelLoadError(_missing_message(path, missing))
        # tensors the model has no place for: a config that leaves out what the weights have (q/k/v biases
        # without attention_bias) would serve without them; transformers has dropped the harmless ones,
        # and fp8 KV scales are read by the engine itself (engine.kv_scales)
        extra = sorted(k for k in info.get("unexpected_keys") or () if not SCALE_NAME.search(k))
        if extra:
            raise ModelLoadError(f"the weights in {path} have {len(extra)} tensors the model has no place for "
                                 f"(e.g. {', '.join(extra[:3])}): does config.json match them?")
        model.to(dev).eval()
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load weights from {path}: {_first_line(e)}") from e
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, config, str(path), dev, dt)
