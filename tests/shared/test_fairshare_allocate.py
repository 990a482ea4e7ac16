"""The allocation rule on its own: weights, batches inside a project, no starvation."""

from __future__ import annotations

from batchwright.worker.lease_child.fairshare import Flow, allocate


def flows(*spec: tuple[str, str, float, int]) -> list[Flow]:
    return [Flow(b, p, w, created_at=i, held=h) for i, (b, p, w, h) in enumerate(spec)]


def test_new_project_gets_slots_before_a_busy_one() -> None:
    # A holds 64 rows of a 20,000-line batch; B arrives with nothing in flight.
    got = allocate(flows(("a1", "A", 1.0, 64), ("b1", "B", 1.0, 0)), 8, {"A": 64})
    assert got == {"b1": 8}


def test_equal_weights_converge_to_equal_shares() -> None:
    got = allocate(flows(("a1", "A", 1.0, 10), ("b1", "B", 1.0, 4)), 10, {"A": 10, "B": 4})
    assert got == {"a1": 2, "b1": 8}  # both end at 12


def test_weights_split_capacity_in_proportion() -> None:
    got = allocate(flows(("a1", "A", 3.0, 0), ("b1", "B", 1.0, 0)), 40, {})
    assert got == {"a1": 30, "b1": 10}


def test_batches_of_one_project_share_its_slots() -> None:
    got = allocate(
        flows(("a1", "A", 1.0, 6), ("a2", "A", 1.0, 0), ("b1", "B", 1.0, 0)), 12, {"A": 6}
    )
    # B catches up with A's 6 and both then grow evenly; inside A the new batch goes first.
    assert got["b1"] == 9 and got["a2"] == 3 and "a1" not in got


def test_no_starvation_with_a_heavy_weight() -> None:
    # Project B's weight is a hundredth of A's: it still gets a row once A holds 100.
    got = allocate(flows(("a1", "A", 1.0, 0), ("b1", "B", 0.01, 0)), 102, {})
    assert got["b1"] >= 1


def test_held_rows_of_drained_batches_count_for_their_project() -> None:
    # A's only queued batch holds nothing, but A holds 32 rows of another (drained) batch.
    got = allocate(flows(("a2", "A", 1.0, 0), ("b1", "B", 1.0, 0)), 8, {"A": 32})
    assert got == {"b1": 8}
