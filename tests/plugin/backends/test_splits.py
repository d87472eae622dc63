"""The row splits of the grouped ops: bounds, device vectors (cached), and no copy inside a CUDA-graph capture."""

import pytest
import torch

from transformer_engine.plugin.backends._splits import split_bounds, split_ends, split_of_rows


def test_bounds_ends_and_rows():
    splits = (2, 0, 3, 1)
    assert split_bounds(splits) == [(0, 2), (2, 2), (2, 5), (5, 6)]
    assert split_ends(splits, "cpu").tolist() == [2, 2, 5, 6] and split_ends(splits, "cpu").dtype == torch.int32
    assert split_of_rows(splits, "cpu").tolist() == [0, 0, 2, 2, 2, 3]


def test_device_vectors_are_cached():
    assert split_ends([4, 4], "cpu") is split_ends((4, 4), "cpu")
    assert split_of_rows([4, 4], "cpu") is split_of_rows((4, 4), "cpu")


@pytest.mark.gpu
def test_no_host_copy_while_a_cuda_graph_is_captured():
    made_before = split_ends((16, 48), "cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        assert split_ends((16, 48), "cuda") is made_before  # from the cache: no copy captured
        with pytest.raises(RuntimeError, match="CUDA graph is captured"):
            split_ends((16, 32, 16), "cuda")
