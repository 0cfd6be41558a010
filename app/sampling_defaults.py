"""The sampling defaults a model folder's ``generation_config.json`` declares (Qwen2.5-Instruct: temperature
0.7, top_p 0.8, top_k 20, repetition_penalty 1.05), which the OpenAI routes use for what a request leaves
unset under ``--sampling-defaults model`` (as vLLM and SGLang do by default). The TGI routes keep TGI's
own defaults: TGI never reads them, and its ``/generate`` is greedy unless asked to sample."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# field -> (kind, what the OpenAI routes accept, as text and as a test): a value a request could not send
# is not a default either
FIELDS: dict[str, tuple[type, str, Callable[[float], bool]]] = {
    "temperature": (float, "0 <= x <= 2", lambda x: 0 <= x <= 2),
    "top_p": (float, "0 < x <= 1", lambda x: 0 < x <= 1),
    "top_k": (int, "an integer >= 0", lambda x: x >= 0),
    "min_p": (float, "0 <= x <= 1", lambda x: 0 <= x <= 1),
    "repetition_penalty": (float, "x > 0", lambda x: x > 0),
    # the default max_tokens (still cut to the room the context leaves), as vLLM takes it
    "max_new_tokens": (int, "an integer >= 1", lambda x: x >= 1),
}

def read_sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling fields ``generation_config.json`` sets, checked; {} without the file. A file that is
    not a JSON object, or a value out of range or of the wrong type, is left out with a warning: a
    model's packaging must not stop the service, nor reach the sampler unchecked."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("%s is unreadable (%s): no sampling defaults from the model", path, e)
        return {}
    if not isinstance(raw, dict):
        log.warning("%s is not a JSON object: no sampling defaults from the model", path)
        return {}
    out: dict[str, float | int] = {}
    for name, (kind, allowed, accepts) in FIELDS.items():
        if name not in raw or raw[name] is None:
            continue
        value = raw[name]
        # bool is an int to Python; a float top_k (20.0) is not a count the API would take either
        ok_type = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or not math.isfinite(value) or not accepts(value):
            log.warning("%s: %s=%r is not a sampling default the API takes (%s): ignored", path, name, value, allowed)
            continue
        out[name] = kind(value)
    return out
