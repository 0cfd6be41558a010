"""Per-layer fp8 KV-cache scales shipped in a checkpoint (value = stored * scale, as the pool keeps them).

Quantization tools write them beside the attention weights, under one of a few names (one scalar per
layer, or per head): ``layers.N.self_attn.{k_scale,v_scale}``, the older one-for-both ``kv_scale``,
``k_proj``/``v_proj`` with ``output_scale``, ``k_scale`` or ``v_scale``, or a fused ``qkv_proj`` with
``k_scale``/``v_scale`` (Phi-3). transformers' models have no such parameters and leave them out of the
load, so they are read here, from the safetensors files, for fp8 pools only. Without them an fp8 pool
stores values as they are (scale 1.0), clamping those past fp8's range.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(k|v|qkv)_proj\.)?(k_scale|v_scale|kv_scale|output_scale)$")


class KVScaleError(ValueError):
    pass


def scale_targets(name: str) -> tuple[int, str] | None:
    """``(layer, "k" | "v" | "kv")`` that a tensor's scale applies to, or None for any other tensor."""
    m = SCALE_NAME.search(name)
    if m is None:
        return None
    layer, proj, kind = int(m[1]), m[2], m[3]
    if proj in ("k", "v"):  # a scale on k_proj or v_proj is that projection's (its output_scale too)
        return layer, proj
    if kind == "output_scale":  # of the fused qkv_proj, or of the attention: not a K or V scale
        return None
    return layer, {"k_scale": "k", "v_scale": "v", "kv_scale": "kv"}[kind]


def check_scale_names(names: set[str], num_layers: int) -> None:
    """Scales for every layer's K and V, or none at all: a partial set would scale some layers and clamp
    the others (a checkpoint from a tool of another layout, or a shard left out)."""
    covered: dict[str, set[int]] = {"k": set(), "v": set()}
    for name in names:
        if (target := scale_targets(name)) is not None:
            for which in target[1]:
                covered[which].add(target[0])
    _all_or_none(covered, num_layers)


def _all_or_none(covered: dict[str, set[int]], num_layers: int) -> None:
    """``covered``: the layers with a K and with a V scale."""
    if not covered["k"] and not covered["v"]:
        return
    for which, layers in covered.items():
        if missing := sorted(set(range(num_layers)) - layers):
            raise KVScaleError(f"the checkpoint has fp8 KV {which.upper()} scales for {len(layers)} of "
                               f"{num_layers} layers (none for layer {missing[0]}): all or none")


def read_kv_scales(files: list[Path], num_layers: int) -> tuple[list[float], list[float]] | None:
    """``(k_scales, v_scales)`` per layer from a checkpoint's safetensors ``files`` (the shards its
    index names), or None when it has none. A per-head scale counts as its largest head's, and a layer
    named twice as its larger value, so no values are clamped."""
    from safetensors import safe_open

    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if (target := scale_targets(name)) is None:
                    continue
                value = float(st.get_tensor(name).to(torch.float32).max())
                if not (value > 0 and value < float("inf")):
                    raise KVScaleError(f"{f.name}: {name} is {value}; a KV scale must be a positive number")
                for which in target[1]:
                    found[which][target[0]] = max(value, found[which].get(target[0], 0.0))
    if not found["k"] and not found["v"]:
        return None
    _all_or_none({w: set(found[w]) for w in "kv"}, num_layers)
    return [found["k"][i] for i in range(num_layers)], [found["v"][i] for i in range(num_layers)]
