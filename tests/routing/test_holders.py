"""The bit-mask holder index against a plain dict of sets, replicas coming and going (slots reused)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.holders import Holders

REPLICAS = [f"r{i}" for i in range(6)]
op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 12), st.sampled_from(REPLICAS)),
    st.tuples(st.just("discard"), st.integers(0, 12), st.sampled_from(REPLICAS)),
    st.tuples(st.just("leave"), st.just(0), st.sampled_from(REPLICAS)),
    st.tuples(st.just("match"), st.integers(0, 12), st.sampled_from(REPLICAS)),
)


def _reference_matches(ref: dict[int, set[str]], chain: list[int], candidates) -> dict[str, int]:
    out = {}
    for r in set().union(*ref.values()) if ref else ():
        if candidates is not None and r not in candidates:
            continue
        d = 0
        while d < len(chain) and r in ref.get(chain[d], ()):
            d += 1
        if d:
            out[r] = d
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=120))
def test_holders_match_a_dict_of_sets(ops):
    h, ref, names = Holders(), {}, {}
    gen = 0
    for kind, x, rid in ops:
        name = names.setdefault(rid, f"{rid}.{gen}")
        if kind == "add":
            assert h.add(x, name) == (name not in ref.get(x, set()))
            ref.setdefault(x, set()).add(name)
        elif kind == "discard":
            h.discard(x, name)
            ref.get(x, set()).discard(name)
        elif kind == "leave":  # it is gone for good; a new replica of a new id may take its slot
            held = [k for k, v in ref.items() if name in v]
            h.remove_replica(name, held if x % 2 else None)
            for v in ref.values():
                v.discard(name)
            gen += 1
            names[rid] = f"{rid}.{gen}"
        else:
            chain = list(range(x, x + 5))
            cands = {names[r] for r in REPLICAS[: 1 + REPLICAS.index(rid)] if r in names}
            assert h.matches(chain) == _reference_matches(ref, chain, None)
            assert h.matches(chain, cands) == _reference_matches(ref, chain, cands)
        ref = {k: v for k, v in ref.items() if v}
        assert h.as_sets() == ref
    assert len(h._ids) <= len(REPLICAS)  # slots were reused: masks stay as wide as the live fleet


def test_a_replica_that_leaves_frees_its_slot_for_the_next_one():
    """Masks stay as short as the fleet: replicas coming and going (each one a new id, as Serve names
    them) must reuse the slots of those gone, or every mask grows by a bit per replica ever seen."""
    h = Holders()
    for i in range(3):
        h.add(7, f"r{i}")
    for gen in range(50):
        gone, new = f"r{gen}" if gen < 3 else f"n{gen - 1}", f"n{gen}"
        h.remove_replica(gone)
        h.add(7, new)
        assert len(h._ids) == 3 and h.masks[7].bit_length() <= 3, (gen, h._ids)
    assert sorted(h.ids(h.masks[7])) == ["n0", "n1", "n49"]
