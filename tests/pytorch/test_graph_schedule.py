"""The capture order of make_graphed_callables (pytorch/graph_schedule.py): one training step by default,
Megatron-Core's interleaved pipeline schedule (NVIDIA TE's ``_order``) with its entry numbering."""

import pytest

from transformer_engine.pytorch.graph_schedule import default_schedule, interleaved_schedule


def _names(schedule):
    return [("F" if forward else "B") + str(entry) for forward, entry in schedule.steps]


def test_default_is_one_training_step():
    schedule = default_schedule(3)
    assert schedule.callable_of == (0, 1, 2)
    assert _names(schedule) == ["F0", "F1", "F2", "B2", "B1", "B0"]


def test_nvidia_te_interleaved_order():
    """NVIDIA TE's own interleaved test: two chunks of one layer, three micro-batches."""
    order = [1, 2, 1, 2, -2, -1, 1, 2, -2, -1, -2, -1]
    schedule = interleaved_schedule(order, None, num_callables=2)
    assert schedule.callable_of == (0, 0, 0, 1, 1, 1)  # entry = chunk * 3 + micro-batch
    assert _names(schedule) == ["F0", "F3", "F1", "F4", "B3", "B0", "F2", "F5", "B4", "B1", "B5", "B2"]


def test_chunks_of_several_layers_run_forward_in_order_and_backward_reversed():
    schedule = interleaved_schedule([1, 2, -2, -1], [2, 1], num_callables=3)
    assert schedule.callable_of == (0, 1, 2)  # one micro-batch: entry (c, 0, l) = P_c + l
    assert _names(schedule) == ["F0", "F1", "F2", "B2", "B1", "B0"]
    two = interleaved_schedule([1, 1, -1, -1], 2, num_callables=2)
    assert two.callable_of == (0, 1, 0, 1)  # entry = m * 2 + l
    assert _names(two) == ["F0", "F1", "F2", "F3", "B1", "B0", "B3", "B2"]


@pytest.mark.parametrize(
    "order,layers,callables,match",
    [
        ([], None, 2, "non-empty"),
        ([1, 0, -1], None, 1, "nonzero"),
        ([1, 2, -1], None, 2, "chunk 2 runs 1 forwards and 0 backwards"),
        ([1, 1, -1], None, 1, "chunk 1 runs 2 forwards and 1 backwards"),
        ([-1, 1], None, 1, r"_order\[0\] = -1: the backward of chunk 1 comes before its forward"),
        ([1, 2, -2, -1], None, 3, "do not split evenly"),
        ([1, 2, -2, -1], [2, 2], 3, "adding up to the 3 callables"),
        ([1, 2, -2, -1], [3], 3, "2 positive layer counts"),
    ],
)
def test_bad_orders_are_named(order, layers, callables, match):
    with pytest.raises(ValueError, match=match):
        interleaved_schedule(order, layers, num_callables=callables)
