"""Chained block hashes, shared by the engine, the router and the Redis directory.

``h_i = xxh3_64(h_{i-1} || tokens of block i)`` over little-endian uint32 token ids, with
``h_{-1}`` derived from ``extra`` (model id and tenant salt). The hash is stable across
processes and machines (unlike Python's ``hash()``), so a router can predict what a replica
caches. A hash identifies a whole prefix, not one block: equal hashes mean equal prefixes
(up to collisions, which every consumer must treat as "maybe": the radix cache compares
tokens, the router only uses hashes as hints).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_SEED = 0x52414458  # "RADX": fixed so every process agrees
_LE = array("I").itemsize == 4 and __import__("sys").byteorder == "little"


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32 bytes (the hash input and the radix key)."""
    arr = array("I", token_ids)
    if not _LE:  # pragma: no cover - big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def root_hash(model_id: str = "", cache_salt: str | None = None) -> int:
    """The chain's seed: isolates models and tenants so identical prompts never share blocks."""
    extra = f"{model_id}\x00{cache_salt or ''}".encode()
    return xxhash.xxh3_64_intdigest(extra, seed=_SEED)


def chain_hashes(packed: bytes, block_size: int, parent: int, start_block: int = 0,
                 end_block: int | None = None) -> list[int]:
    """Hashes of full blocks ``start_block..end_block`` of already-packed tokens.

    ``parent`` is the hash of block ``start_block - 1`` (or the root hash when 0).
    """
    step = block_size * 4
    n_full = len(packed) // step
    end = n_full if end_block is None else min(end_block, n_full)
    out: list[int] = []
    h = parent
    digest = xxhash.xxh3_64_intdigest
    for i in range(start_block, end):
        h = digest(packed[i * step:(i + 1) * step], seed=h)
        out.append(h)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, model_id: str = "",
                 cache_salt: str | None = None) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (a partial tail block is not hashed)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return chain_hashes(pack_tokens(token_ids), block_size, root_hash(model_id, cache_salt))
