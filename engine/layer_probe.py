"""Ask a loaded model's layers what they would ask of attention before serving it: one token through the
model, each layer recording its call instead of attending. The engine plans each layer's window from
config.json (``engine.model_support.layer_windows``); a layer that asks for another one, or that never
comes through the engine's attention (so never reads or writes the paged KV cache), would serve wrong
tokens without an error, so such a model is refused at start-up."""

from __future__ import annotations

import torch

from engine.attention import PROBE_KWARG
from engine.model_support import binding_window


def probe_layers(model, device: torch.device) -> dict[int, dict]:
    """Layer index -> what it passed to attention (``sliding_window``, its grouped-query factor)."""
    asked: dict[int, dict] = {}
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=ids, use_cache=False, logits_to_keep=1, **{PROBE_KWARG: asked})
    return asked


def layer_problem(model, device: torch.device, windows: tuple[int | None, ...]) -> str | None:
    """Why the engine would compute this model wrongly, from what its layers ask (None: they ask for
    what config.json says, every one of them through the engine's attention)."""
    try:
        asked = probe_layers(model, device)
    except Exception as e:  # noqa: BLE001 - any failure here means its layers do not call attention as expected
        first = (str(e).strip().splitlines() or [""])[0]
        return f"its layers do not call attention the way the engine serves it ({type(e).__name__}: {first})"
    missing = [i for i in range(len(windows)) if i not in asked]
    if missing:
        return (f"{len(missing)} of its {len(windows)} layers (e.g. layer {missing[0]}) do not attend through the "
                "engine's paged attention")
    for i, window in enumerate(windows):
        if binding_window(asked[i]["sliding_window"], model.config) != window:
            if asked[i]["sliding_window"] is None:
                return (f"config.json sets a sliding window of {window} tokens that transformers' layer {i} does not "
                        "pass to attention (it applies it through its own mask, or not at all): the engine cannot "
                        "tell which, and serves neither")
            return (f"layer {i} attends with sliding_window={asked[i]['sliding_window']} in transformers, where the "
                    f"engine reads {window} from config.json")
    return None
