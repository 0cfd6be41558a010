"""Paged KV pool: per-layer K and V tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.

Allocated once at start-up on any torch device. Tokens are written by *slot* (``block * block_size
+ offset``) and read back by block table. fp8 dtypes are stored as raw bytes with a per-layer scale
and dequantized to the compute dtype on read: no backend we target reads fp8 KV directly on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3fn", "fp8_e5m2")
_FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype | None]:
    """(storage dtype, fp8 dtype or None). ``auto`` stores in the model's compute dtype."""
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return compute_dtype, None
    if kv_cache_dtype in _FP8:
        return torch.uint8, _FP8[kv_cache_dtype]
    return _FLOAT[kv_cache_dtype], None


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                    compute_dtype: torch.dtype = torch.float32) -> int:
    """KV bytes one token costs across all layers (K and V)."""
    storage, _ = resolve_kv_dtype(kv_cache_dtype, compute_dtype)
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=storage).element_size()


# On a GPU the pool is allocated after the weights, and a step then needs room beside it: activations
# of the largest prefill, the CUDA graphs' memory, cuBLAS workspaces. This much stays free whatever
# kv_memory_fraction says (1.0 took every byte, and the first step ran out of memory).
GPU_RESERVE_FRACTION = 0.05
GPU_RESERVE_MIN_BYTES = 1 << 30


def gpu_reserve(device: torch.device) -> int:
    """Bytes a GPU keeps free beside its KV pool (none on a CPU)."""
    if device.type != "cuda":
        return 0
    _free, total = torch.cuda.mem_get_info(device)
    return max(GPU_RESERVE_MIN_BYTES, int(total * GPU_RESERVE_FRACTION))


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool on ``device`` (CUDA: free device memory, less ``gpu_reserve``;
    CPU: MemAvailable)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks torch has cached but does not use (loading left some) are free
        free, _total = torch.cuda.mem_get_info(device)
        return max(0, int(free) - gpu_reserve(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# blocks a pool allocates past those it hands out: padded rows of a fixed-shape (CUDA graph) batch write there
PAD_BLOCKS = 1


def pool_problem(num_blocks: int, block_size: int, token_bytes: int, device: torch.device,
                 replicas: int = 1) -> str | None:
    """Why a pool of ``num_blocks`` (and its padding block) cannot be allocated on ``device`` now (more than
    its free memory), else None: said at start-up instead of the allocator's own error. ``replicas``: that
    many start here at once, each with its own pool."""
    if device.type not in ("cpu", "cuda"):
        return None  # no free-memory reading of its own here: the allocator's error will say
    try:
        free = available_memory(device)
    except (OSError, ValueError):  # no /proc/meminfo nor sysconf's count (not Linux)
        return None
    tokens = num_blocks * block_size
    need = (num_blocks + PAD_BLOCKS) * block_size * token_bytes
    if need * replicas <= free:
        return None
    room = "free" if device.type == "cpu" else "free beside a step's working memory"
    each = f" ({replicas} replicas start here, one pool each: {need * replicas / 2**30:.1f} GiB)" if replicas > 1 else ""
    return (f"a KV pool of {tokens} tokens (max_batch_total_tokens) needs {need / 2**30:.1f} GiB{each}, more than "
            f"the {free / 2**30:.1f} GiB {room} on {device}")


# A CPU replica's pool without a size given: a fraction of the machine's memory, but at most this
# (vLLM's CPU default too): 30% of a large server's RAM would be tens of GB for a model that runs a few
# sequences at a time, and every replica on the machine takes its own
CPU_POOL_CAP_BYTES = 4 << 30


def num_blocks_for(block_size: int, token_bytes: int, max_batch_total_tokens: int | None,
                   memory_fraction: float, device: torch.device) -> int:
    """Pool size: from ``max_batch_total_tokens`` when given, else a fraction of free memory (on a CPU,
    at most ``CPU_POOL_CAP_BYTES``), the pool's padding block (``KVPool``) within it."""
    if max_batch_total_tokens is not None:
        return max(1, max_batch_total_tokens // block_size)
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    budget = int(available_memory(device) * memory_fraction)
    if device.type == "cpu":
        budget = min(budget, CPU_POOL_CAP_BYTES)
    return max(1, budget // (token_bytes * block_size) - PAD_BLOCKS)


FP16_MAX = torch.finfo(torch.float16).max


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


class KVPool:
    def __init__(self, shape: KVShape, kv_cache_dtype: str = "auto",
                 compute_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.shape = shape
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.storage_dtype, self.fp8_dtype = resolve_kv_dtype(kv_cache_dtype, compute_dtype)
        s = shape
        # One allocation for all layers: [layers, 2 (K, V), blocks + 1, block_size, heads, head_dim] (PAD_BLOCKS). The
        # last block is never handed out: padded rows of a fixed-shape (CUDA graph) batch write there.
        self._rows = (s.num_blocks + PAD_BLOCKS) * s.block_size
        self._data = torch.zeros((s.num_layers, 2, s.num_blocks + PAD_BLOCKS, s.block_size, s.num_kv_heads, s.head_dim),
                                 dtype=self.storage_dtype, device=self.device)
        # Per-layer scales for fp8 (value = stored * scale); 1.0 unless calibrated or set.
        self.k_scale = torch.ones(s.num_layers, dtype=torch.float32)
        self.v_scale = torch.ones(s.num_layers, dtype=torch.float32)
        self._fp8_max = torch.finfo(self.fp8_dtype).max if self.fp8_dtype is not None else 0.0
        if self.fp8_dtype is not None:  # at start-up, not in the first request's step (MPS has no fp8 casts)
            try:
                self._decode(self._encode(torch.ones(2, dtype=compute_dtype, device=self.device), 1.0), 1.0)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"kv_cache_dtype {kv_cache_dtype} cannot be stored on {self.device.type} with this "
                                 f"torch ({str(e).splitlines()[0][:200]}): use auto, bfloat16 or float16") from None

    # ------------------------------------------------------------------ facts
    @property
    def num_blocks(self) -> int:
        return self.shape.num_blocks

    @property
    def pad_slot(self) -> int:
        """A slot outside every block the allocator hands out: where padding rows write their K/V."""
        return self.shape.num_blocks * self.shape.block_size

    @property
    def bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self._data.element_size()

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw per-layer (K, V) storage ``[num_blocks, block_size, heads, head_dim]`` (for kernels
        that read the paged layout directly; fp8 pools return bytes)."""
        return self._data[layer, 0], self._data[layer, 1]

    def set_scales(self, k_scale: torch.Tensor | list[float], v_scale: torch.Tensor | list[float]) -> None:
        """Per-layer fp8 scales. Before CUDA graphs are captured: a graph keeps the values it saw. Kept
        on the host (calibrated scales often come as CUDA tensors): each read is then a number, not a
        wait for the device, and no sync lands inside a graph's capture."""
        n = self.shape.num_layers
        self.k_scale = torch.as_tensor(k_scale, dtype=torch.float32).detach().cpu().reshape(n).clone()
        self.v_scale = torch.as_tensor(v_scale, dtype=torch.float32).detach().cpu().reshape(n).clone()

    # ------------------------------------------------------------------ write / read
    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fp8_dtype is None:
            y = x.to(self.storage_dtype)
            if self.storage_dtype == torch.float16 and x.dtype != torch.float16:  # a bf16/fp32 model's
                # outliers past fp16's range would be stored as inf and turn scores into NaN
                y = torch.nan_to_num(y, nan=float("nan"), posinf=FP16_MAX, neginf=-FP16_MAX)
            return y
        y = (x.float() / scale).clamp_(-self._fp8_max, self._fp8_max)  # fp8 e4m3fn has no inf
        return y.to(self.fp8_dtype).view(torch.uint8)

    def _decode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fp8_dtype is None:
            return x.to(self.compute_dtype)
        return (x.view(self.fp8_dtype).float() * scale).to(self.compute_dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, heads, head_dim]`` at flat ``slots`` ``[T]`` (block*block_size+offset)."""
        s = self.shape
        flat = self._data[layer].view(2, self._rows, s.num_kv_heads, s.head_dim)
        flat[0].index_copy_(0, slots, self._encode(k, float(self.k_scale[layer])))
        flat[1].index_copy_(0, slots, self._encode(v, float(self.v_scale[layer])))

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one sequence ``[n_blocks*block_size (or num_tokens), heads, head_dim]`` in
        compute dtype, read through ``block_table`` ``[n_blocks]``."""
        s = self.shape
        kv = self._data[layer][:, block_table]  # [2, n, B, H, D]
        kv = kv.reshape(2, -1, s.num_kv_heads, s.head_dim)
        if num_tokens is not None:
            kv = kv[:, :num_tokens]
        return self._decode(kv[0], float(self.k_scale[layer])), self._decode(kv[1], float(self.v_scale[layer]))

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at arbitrary flat slots ``[T]`` in compute dtype (the attention backends' gather)."""
        s = self.shape
        flat = self._data[layer].view(2, self._rows, s.num_kv_heads * s.head_dim)
        k = flat[0].index_select(0, slots).view(-1, s.num_kv_heads, s.head_dim)
        v = flat[1].index_select(0, slots).view(-1, s.num_kv_heads, s.head_dim)
        return self._decode(k, float(self.k_scale[layer])), self._decode(v, float(self.v_scale[layer]))

    def read_heads(self, layer: int, head_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V rows ``[..., head_dim]`` at ``head_slots = slot * num_kv_heads + head`` of any shape: lets
        decode attention gather straight into a head-major ``[seqs, heads, tokens, head_dim]`` layout."""
        s = self.shape
        rows = self._data[layer].view(2, self._rows * s.num_kv_heads, s.head_dim)
        idx = head_slots.reshape(-1)
        shape = (*head_slots.shape, s.head_dim)
        k = rows[0].index_select(0, idx).view(shape)
        v = rows[1].index_select(0, idx).view(shape)
        return self._decode(k, float(self.k_scale[layer])), self._decode(v, float(self.v_scale[layer]))
