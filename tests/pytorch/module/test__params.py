"""Split parameters (``parameters_split``) live back to back in one buffer: the full weight is a view, not a copy."""

import torch

import transformer_engine.pytorch as te
from transformer_engine.pytorch.module._params import _back_to_back


def _split_layer():
    return te.Linear(32, 96, parameters_split=("query", "key", "value"))


def _grads(layer, x, full_weight_fn):
    layer.zero_grad(set_to_none=True)
    y = torch.nn.functional.linear(x, full_weight_fn(layer))
    y.square().sum().backward()
    return [p.grad.clone() for p in (layer.query_weight, layer.key_weight, layer.value_weight)]


def test_the_full_weight_is_a_view_of_the_splits_with_their_gradients():
    layer = _split_layer()
    splits = [layer.query_weight, layer.key_weight, layer.value_weight]
    assert _back_to_back(splits)
    full = layer.layout.weight(layer)
    assert full.data_ptr() == layer.query_weight.data_ptr() and full.shape == (96, 32)
    assert torch.equal(full.detach(), torch.cat(splits).detach())
    x = torch.randn(5, 32)
    via_view = _grads(layer, x, lambda m: m.layout.weight(m))
    via_cat = _grads(layer, x, lambda m: torch.cat([m.query_weight, m.key_weight, m.value_weight]))
    assert all(torch.equal(a, b) for a, b in zip(via_view, via_cat))
    bias = layer.layout.bias(layer)
    assert bias.data_ptr() == layer.query_bias.data_ptr() and bias.shape == (96,)


def test_splits_in_separate_storages_are_concatenated():
    layer = _split_layer().to(torch.float64)  # .to() gives every parameter its own storage
    splits = [layer.query_weight, layer.key_weight, layer.value_weight]
    full = layer.layout.weight(layer)
    assert torch.equal(full.detach(), torch.cat(splits).detach())
    assert not _back_to_back(splits) or full.data_ptr() == splits[0].data_ptr()
    assert not _back_to_back([splits[1], splits[0]])  # out of order: not a view
