"""The one object that owns the order of a loop's inputs and outputs."""
from torch_xla_ext.scan.signature import CallLayout, Signature, Slot, SlotKind, split_list


def test_split_list_cuts_consecutive_groups_and_the_rest():
    assert split_list("abcdef", [1, 2]) == [["a"], ["b", "c"], ["d", "e", "f"]]
    assert split_list([], [0, 0]) == [[], [], []]


def test_signature_splits_inputs_and_outputs_and_names_their_slots():
    signature = Signature(carries=2, sliced=1, invariants=2, stacked=1)
    assert signature.split_inputs(["c0", "c1", "x0", "i0", "i1"]) == [
        ["c0", "c1"], ["x0"], ["i0", "i1"]]
    assert signature.split_outputs(["c0", "c1", "s0"]) == [["c0", "c1"], ["s0"]]
    assert signature.output_slots(accumulated=1) == [
        Slot(SlotKind.CARRY, 0), Slot(SlotKind.ACCUMULATE, 1), Slot(SlotKind.STACKED, 0)]
    carry, sliced, invariant = object(), object(), object()
    slots = signature.input_slots([carry, None], [sliced], [invariant])
    assert slots == {id(carry): (carry, Slot(SlotKind.CARRY, 0)),
                     id(sliced): (sliced, Slot(SlotKind.SLICED, 0)),
                     id(invariant): (invariant, Slot(SlotKind.INVARIANT, 0))}


# A call with carries (a, b, c), b read-only; xs (x0, x1), x1 written in place;
# captures (k0, k1), k0 written in place; ys (y0, y1), y1 being x0 passed through.
LAYOUT = CallLayout.of(read_only=[False, True, False], capture_count=2, written_captures=[0],
                       y_sources=[None, 0], x_count=2, written_x=[1])


def test_call_inputs_go_to_the_loop_groups_and_back():
    loop = LAYOUT.loop_inputs(["a", "b", "c"], ["x0", "x1"], ["k0", "k1"],
                              written=lambda t: t.upper())
    assert loop == (["a", "c", "K0"], ["x0", "X1"], ["b", "k1"])
    assert LAYOUT.call_inputs(*loop) == (["a", "b", "c"], ["x0", "X1"], ["K0", "k1"])
    assert LAYOUT.signature() == Signature(carries=3, sliced=2, invariants=2, stacked=2)


def test_loop_outputs_become_the_calls_carry_ys_and_written_values():
    carries, stacked = LAYOUT.loop_outputs(["a'", "b", "c'"], ["k0'", "k1"], ["y0", "x0"],
                                           ["x0", "x1'"])
    assert (carries, stacked) == (["a'", "c'", "k0'"], ["y0", "x1'"])
    carry, ys, written = LAYOUT.call_outputs(["a", "b", "c"], ["x0", "x1"], carries, stacked)
    assert carry == ["a'", "b", "c'"]
    assert ys == ["y0", "x0"]
    assert written == ["k0'", "x1'"]
    assert LAYOUT.written_inputs(["x0", "x1"], ["k0", "k1"]) == ["k0", "x1"]
