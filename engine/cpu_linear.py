"""Faster linear layers for decode-sized batches on the CPU.

With a few token rows (a decode step), MKL's float32 GEMM behind ``nn.Linear`` (``x @ W.T``) runs far
below the memory bandwidth on the x86 CPUs we measured, while the same product taken as
``(W @ x.T).T`` picks another kernel: the bench model's decode step went from ~38 to ~29 ms, its
32k-vocabulary lm_head alone from 9.8 to 4.3 ms at 8 rows. Many rows (prefill chunks) keep
``F.linear``, which is faster there. CUDA models are left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` whose forward takes the transposed GEMM for at most ``MAX_ROWS`` rows."""

    MAX_ROWS = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows > self.MAX_ROWS or x.dim() < 2:
            return F.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def use_skinny_linear(model: nn.Module) -> int:
    """Switch ``model``'s plain linear layers to ``SkinnyLinear`` in place (same weights); returns how
    many. Only worth it (and only done by the engine) for float32 models on the CPU."""
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = SkinnyLinear
            n += 1
    return n
