"""The KV manager's admission after a preemption: a sequence takes back its own blocks unprotected."""

from __future__ import annotations

import pytest

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
    """Reuse marks along the cached path of ``tokens``, root first (looking does not mark)."""
    node, out = kv.cache.match(tokens + [0], own_blocks=10**9).node, []
    while node is not None and not node.is_root:
        out += [node.reused] * len(node.blocks)
        node = node.parent
    return out[::-1]


def test_readmission_after_preemption_does_not_mark_own_blocks_reused():
    kv = KVManager(num_blocks=16, block_size=BS)
    seq = Sequence("a", [3] * 12, SamplingParams())
    admit_and_publish(kv, seq)
    kv.release(seq)  # preempted: its published blocks stay cached
    kv.match(seq)  # re-admitted: takes them back
    assert seq.num_computed == 8  # the last block is recomputed for its logits
    assert protected(kv, [3] * 12) == [False, False, False]
    kv.release(seq)
    other = Sequence("b", [3] * 8 + [4] * 4, SamplingParams())  # another request sharing the prefix
    kv.match(other)
    assert protected(kv, [3] * 12) == [True, True, False]
    kv.release(other)
    kv.check([])


def test_readmission_marks_blocks_others_published_while_it_waited():
    kv = KVManager(num_blocks=16, block_size=BS)
    seq = Sequence("a", [3] * 16, SamplingParams())
    kv.match(seq)
    kv.count_admission(seq)
    assert kv.ensure_blocks(seq, 8)
    seq.num_computed = 8  # a first chunk of its prompt, then preempted
    kv.publish(seq)
    kv.release(seq)
    twin = Sequence("b", [3] * 16, SamplingParams())  # the same prompt, computed in full meanwhile
    admit_and_publish(kv, twin)
    kv.release(twin)
    assert protected(kv, [3] * 16) == [True, True, False, False]  # the twin reused the first two
    kv.match(seq)  # takes back its 2 blocks and matches 1 more of the twin's: a real reuse
    assert seq.num_computed == 12
    assert protected(kv, [3] * 16) == [True, True, True, False]
    kv.release(seq)
    kv.check([])


def test_a_later_choice_of_one_call_neither_protects_nor_heats_the_prompt_it_finds():
    """``n``/``best_of``: the first choice computes the prompt, the others find it cached. That is one
    client's prompt, not a shared one: a sibling leaves it unprotected and out of the working set,
    where a request of its own would mark both."""
    kv = KVManager(num_blocks=16, block_size=BS)
    prompt = [3] * 12
    admit_and_publish(kv, first := Sequence("first", prompt, SamplingParams()))
    kv.release(first)
    sibling = Sequence("sibling", prompt, SamplingParams(), sibling=True)
    kv.match(sibling)
    assert sibling.num_computed == 8  # it still takes the cached blocks
    since = kv.cache.wall_clock() - 60
    assert protected(kv, prompt) == [False, False, False] and kv.cache.hot_blocks(since) == 0
    kv.release(sibling)
    other = Sequence("other", prompt, SamplingParams())
    kv.match(other)
    assert protected(kv, prompt) == [True, True, False] and kv.cache.hot_blocks(since) == 2
    kv.release(other)
    kv.check([])


def test_the_check_sees_a_lock_no_request_owns_and_cached_blocks_off_the_locked_path():
    """Found by a review: the books balanced in both cases, which a future leak or lost lock would cause."""
    kv = KVManager(num_blocks=8, block_size=BS)
    seq = Sequence("a", list(range(12)), SamplingParams())
    admit_and_publish(kv, seq)
    kv.check([seq])
    with pytest.raises(AssertionError, match="no live request owns"):
        kv.check([])  # "a" ended without its release: its lock stays, and its blocks can never be evicted
    kv.release(seq)
    kv.check([])

    kv = KVManager(num_blocks=4, block_size=BS)
    seq = Sequence("b", list(range(12)), SamplingParams())
    admit_and_publish(kv, seq)
    kv.cache.unlock(seq.lock_node)  # a lost lock: its cached blocks go to the next allocation
    other = Sequence("c", [1] * 16, SamplingParams())
    other.block_table = kv.allocator.allocate(4)
    with pytest.raises(AssertionError, match="a removed node|not the path it locked"):  # (evicted: removed)
        kv.check([seq, other])
