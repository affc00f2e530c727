"""Deadlines: the earliest is known without a scan, due keys come out once
in deadline order, and discarded or replaced deadlines never fire."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer.deadlines import Deadlines


def test_due_keys_come_out_earliest_first_then_by_key() -> None:
    d: Deadlines[str] = Deadlines()
    for key, at in [("c", 3.0), ("b", 1.0), ("a", 3.0), ("z", 9.0)]:
        d.set(key, at)
    assert d.earliest() == 1.0 and len(d) == 4
    assert d.pop_due(0.5) == []
    assert d.pop_due(3.0) == ["b", "a", "c"]
    assert d.earliest() == 9.0 and "z" in d and "a" not in d
    assert d.pop_due(3.0) == []


def test_a_discarded_key_never_fires_and_leaves_the_top() -> None:
    d: Deadlines[str] = Deadlines()
    d.set("gone", 1.0)
    d.set("kept", 2.0)
    d.discard("gone")
    d.discard("never-set")
    assert d.earliest() == 2.0
    assert d.pop_due(5.0) == ["kept"]
    assert d.earliest() is None and len(d) == 0


def test_a_new_deadline_replaces_the_old_one() -> None:
    d: Deadlines[str] = Deadlines()
    d.set("k", 1.0)
    d.set("k", 4.0)
    assert d.earliest() == 4.0 and d.pop_due(2.0) == []
    d.set("k", 4.0)  # the same deadline twice still fires once
    assert d.pop_due(4.0) == ["k"] and d.pop_due(4.0) == []


def test_stale_entries_are_compacted_away() -> None:
    d: Deadlines[int] = Deadlines()
    for i in range(10_000):  # each key set, then discarded: all stale
        d.set(i, float(i))
        d.discard(i)
    d.set(-1, 0.0)
    assert len(d) == 1 and d.num_stored <= 2 * len(d) + 64 + 1
    assert d.pop_due(1e9) == [-1]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["set", "discard", "pop"]),
        st.integers(0, 5),
        st.integers(0, 20).map(float),
    ),
    max_size=60,
)


@given(OPS)
def test_behaves_like_a_dict_scanned_on_every_call(
    ops: list[tuple[str, int, float]],
) -> None:
    d: Deadlines[int] = Deadlines()
    model: dict[int, float] = {}
    for op, key, at in ops:
        if op == "set":
            d.set(key, at)
            model[key] = at
        elif op == "discard":
            d.discard(key)
            model.pop(key, None)
        else:
            expected = sorted((t, k) for k, t in model.items() if t <= at)
            assert d.pop_due(at) == [k for _, k in expected]
            for _, k in expected:
                del model[k]
        assert d.earliest() == min(model.values(), default=None)
        assert len(d) == len(model)
