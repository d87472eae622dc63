"""TE's mask rules (_masks): names, window rules, alignment, and which calls need explicit tensors."""

from __future__ import annotations

import pytest
import torch

from tests.pytorch.attention._reference import allowed_mask
from transformer_engine.pytorch.attention import _masks


@pytest.mark.parametrize(
    "name,canonical",
    [("padding,causal", "padding_causal"), ("causal,padding", "padding_causal"), ("causal_padding", "padding_causal"),
     ("padding_causal_bottom_right", "padding_causal_bottom_right"), ("arbitrary", "arbitrary")],
)
def test_canonical_names(name, canonical):
    assert _masks.canonical_mask_type(name) == canonical


@pytest.mark.parametrize(
    "mask_type,given,expected",
    [("causal", None, (-1, 0)), ("causal", (4, 0), (4, 0)), ("no_mask", None, (-1, -1)), ("padding", (2, 3), (2, 3)),
     ("arbitrary", (0, 0), (0, 0))],
)
def test_window_rules(mask_type, given, expected):
    assert _masks.check_set_window_size(mask_type, given) == expected


@pytest.mark.parametrize("mask_type,window", [("causal", (-3, 0)), ("no_mask", (2, -1)), ("padding", (-1, 3))])
def test_invalid_windows(mask_type, window):
    with pytest.raises(ValueError, match="window_size"):
        _masks.check_set_window_size(mask_type, window)


@pytest.mark.parametrize(
    "mask_type,given,expected",
    [("causal", True, False), ("padding_causal", None, False), ("causal_bottom_right", False, True),
     ("no_mask", None, True), ("padding", False, False), ("arbitrary", True, True)],
)
def test_alignment(mask_type, given, expected):
    assert _masks.resolve_bottom_right(mask_type, given) is expected


def _spec(mask_type, window=None, bottom_right=None):
    return _masks.MaskSpec(mask_type, _masks.check_set_window_size(mask_type, window),
                           _masks.resolve_bottom_right(mask_type, bottom_right))


def test_catalog_expresses_what_it_can():
    plan = _masks.plan_masks(_spec("causal"), 5, 7, None, None, None, thd=False, device="cpu")
    assert (plan.mask_type, plan.window_size, plan.attn_mask) == ("causal", (-1, -1), None)
    plan = _masks.plan_masks(_spec("no_mask", (2, 1)), 5, 7, None, None, None, thd=False, device="cpu")
    assert (plan.mask_type, plan.window_size, plan.attn_mask) == ("no_mask", (2, 1), None)
    plan = _masks.plan_masks(_spec("causal", (2, 0)), 6, 6, None, None, torch.ones(4), thd=False, device="cpu")
    assert plan.attn_mask is None and plan.alibi_bias is None, "top-left == bottom-right when s_q == s_kv"


@pytest.mark.parametrize(
    "mask_type,window,bottom_right",
    [("causal", (2, 0), None), ("no_mask", (1, 1), False), ("padding", None, None), ("padding_causal_bottom_right", (1, 0), None)],
)
def test_explicit_masks_follow_the_rules(mask_type, window, bottom_right):
    s_q, s_kv = 4, 6
    lens_q, lens_kv = [4, 2], [6, 3]
    padding = _masks.padding_from_lengths(torch.tensor(lens_q), torch.tensor(lens_kv), s_q, s_kv) if "padding" in mask_type else None
    spec = _spec(mask_type, window, bottom_right)
    plan = _masks.plan_masks(spec, s_q, s_kv, padding, None, None, thd=False, device="cpu")
    assert plan.mask_type == "no_mask" and plan.window_size == (-1, -1)
    want = allowed_mask(2, s_q, s_kv, mask_type, spec.window_size, spec.bottom_right, lens_q, lens_kv)
    assert torch.equal(~plan.attn_mask.expand(2, 1, s_q, s_kv), want)


def test_padding_from_mask_pair():
    mask_q = torch.tensor([[False, False, True]]).reshape(1, 1, 1, 3)
    mask_kv = torch.tensor([[False, True, True, True]]).reshape(1, 1, 1, 4)
    padding = _masks.padding_from_mask((mask_q, mask_kv), 3, 4)
    assert padding.lens_q.tolist() == [2] and padding.lens_kv.tolist() == [1]
    with pytest.raises(ValueError, match="pair"):
        _masks.padding_from_mask(mask_q, 3, 4)
