"""A faster output projection (lm_head) for decode-sized batches on the CPU.

With a few token rows (a decode step), MKL's float32 GEMM behind ``nn.Linear`` (``x @ W.T``) runs far
below the memory bandwidth on the x86 CPU we measured, while the same product taken as ``(W @ x.T).T``
picks another kernel: the bench model's 32k-vocabulary lm_head went from 9.8 to 4.3 ms at 8 rows, its
decode step from ~38 to ~32 ms. Many rows (prefill chunks) keep ``F.linear``, which is faster there.
Only the output projection is switched: the body's small layers gained nothing measurable, and their
changed rounding, carried through every layer, flipped a near-tie greedy token against transformers'
own ``generate`` (1 of 64 bench outputs). CUDA models are left alone.
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
    """Switch the plain linear layers in ``model`` to ``SkinnyLinear`` in place (same weights); returns
    how many. The engine passes a float32 CPU model's output projection."""
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = SkinnyLinear
            n += 1
    return n
