"""The bench model, loaded for an engine-level bench: written if missing, float32 on a CPU with one
torch thread (the benches compare steps, and one thread keeps two cores' noise out), bf16 on CUDA."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model_init import write_model
from engine.model_loader import load_model


def load_bench_model(model_dir: str | None = None):
    path = Path(model_dir or Path.home() / ".cache" / "radixserve" / "models" / "bench")
    if not (path / "config.json").exists():
        write_model(path, "bench")
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    return load_model(str(path), device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32")
