"""Clip factors and clipping groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dplightning.privacy.clipping import available_clipping, clip_factors, joint_sensitivity, make_clip_groups


def test_clip_factors_bound_every_norm() -> None:
    norms = torch.tensor([0.0, 0.5, 1.0, 3.0, 1e6])
    clipped = norms * clip_factors(norms, 1.0)
    assert (clipped <= 1.0).all()
    torch.testing.assert_close(clip_factors(norms, 1.0)[:2], torch.ones(2))


def test_non_finite_norms_get_factor_zero() -> None:
    factors = clip_factors(torch.tensor([float("nan"), float("inf"), 2.0]), 1.0)
    assert factors[:2].tolist() == [0.0, 0.0] and factors[2] > 0


@pytest.mark.parametrize("policy", ["flat", "per_layer"])
def test_joint_sensitivity_is_max_grad_norm(policy: str) -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.LayerNorm(2))
    groups = make_clip_groups(policy, list(net.named_parameters()), 2.5)
    assert math.isclose(joint_sensitivity(groups), 2.5)
    assert sorted(id(p) for g in groups for p in g.params) == sorted(id(p) for p in net.parameters())


def test_per_layer_groups_weight_and_bias_of_a_module_together() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    groups = make_clip_groups("per_layer", list(net.named_parameters()), 1.0)
    assert [g.name for g in groups] == ["0", "1"]
    assert all(len(g.params) == 2 for g in groups)


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="flat"):
        make_clip_groups("nope", [], 1.0)
    assert {"flat", "per_layer"} <= set(available_clipping())
