"""The KV manager's admission after a preemption: the sequence takes back its own blocks unprotected."""

from __future__ import annotations

from engine.kv_manager import KVManager
from engine.sequence import SamplingParams, Sequence

BS = 4


def admit_and_publish(kv: KVManager, seq: Sequence) -> None:
    kv.match(seq)
    kv.count_admission(seq)
    assert kv.ensure_blocks(seq, len(seq.tokens))
    seq.num_computed = len(seq.tokens)
    kv.publish(seq)


def protected(kv: KVManager, tokens: list[int]) -> list[bool]:
    node, out = kv.cache.match(tokens + [0], reuse=False).node, []
    while node is not None and not node.is_root:
        out.append(node.reused)
        node = node.parent
    return out


def test_readmission_after_preemption_does_not_mark_own_blocks_reused():
    kv = KVManager(num_blocks=16, block_size=BS)
    seq = Sequence("a", [3] * 12, SamplingParams())
    admit_and_publish(kv, seq)
    kv.release(seq)  # preempted: its published blocks stay cached
    kv.match(seq)  # re-admitted: takes them back
    assert seq.num_computed == 8  # the last block is recomputed for its logits
    assert protected(kv, [3] * 12) and not any(protected(kv, [3] * 12))
    kv.release(seq)
    other = Sequence("b", [3] * 8 + [4] * 4, SamplingParams())  # another request sharing the prefix
    kv.match(other)
    assert any(protected(kv, [3] * 8))
    kv.release(other)
    kv.check([])
