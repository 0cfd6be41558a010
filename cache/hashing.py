"""Chained block hashes, shared by the engine, the router and the Redis directory.

``h_i = xxh3_64(tokens of block i, seed=h_{i-1})`` over little-endian uint32 token ids, with
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


# Replicas report the hashes they stored and evicted to every router through Serve's controller,
# which renders each report with str() whenever one changes: a list of 40,000 ints took it ~6 ms a
# report, a hex string of them ~1 ms (and pickles 30x faster). 16 hex digits a hash, big-endian, so
# a router can read any slice of them without decoding the rest.
HEX_DIGITS = 16


def pack_hashes(hashes: Sequence[int]) -> str:
    """Block hashes as one hex string (``PackedHashes`` reads it)."""
    arr = array("Q", hashes)
    if _LE:
        arr.byteswap()
    return arr.tobytes().hex()


class PackedHashes(Sequence[int]):
    """The hashes of a ``pack_hashes`` string, decoded a slice at a time as they are read."""

    __slots__ = ("_text",)

    def __init__(self, text: str):
        if len(text) % HEX_DIGITS:
            raise ValueError(f"packed hashes come {HEX_DIGITS} hex digits each, got {len(text)} digits")
        self._text = text

    def __len__(self) -> int:
        return len(self._text) // HEX_DIGITS

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            stop = max(start, stop)
            # (fromhex skips whitespace: digits that read as fewer hashes are not hashes)
            arr = array("Q", bytes.fromhex(self._text[start * HEX_DIGITS:stop * HEX_DIGITS]))
            if len(arr) != stop - start:
                raise ValueError("packed hashes hold other characters than hex digits")
            if _LE:
                arr.byteswap()
            return arr.tolist()
        i = range(len(self))[index]  # (negative indices, and IndexError past the end)
        return self[i:i + 1][0]


def reported_hashes(value) -> Sequence[int]:
    """A report's hash list: packed by this version's replicas, a plain list by older ones (a fleet
    in the middle of a rolling update has both)."""
    if isinstance(value, str):
        return PackedHashes(value)
    return value or ()
