"""Clip factors and clipping groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dplightning.privacy.clipping import (
    available_clipping,
    clip_factors,
    joint_sensitivity,
    make_clip_groups,
    split_max_grad_norm,
)


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


@pytest.mark.parametrize(
    "weights", [[1.0], [1.0] * 3, [1.0] * 19, [4.0, 1.0], [120.0, 8.0, 8.0, 1.0], [0.0, 2.0], list(range(1, 40))]
)
@pytest.mark.parametrize("c", [1.0, 0.05, 3.7])
def test_the_split_of_c_keeps_the_joint_sensitivity_and_follows_the_weights(weights: list[float], c: float) -> None:
    bounds = split_max_grad_norm(c, weights)
    assert math.isclose(math.sqrt(math.fsum(b * b for b in bounds)), c, rel_tol=1e-12)
    for b, w in zip(bounds, weights):
        assert math.isclose(b, c * math.sqrt(w / math.fsum(weights)), rel_tol=1e-12, abs_tol=1e-300)
    if len(set(weights)) == 1:
        assert bounds == [c / math.sqrt(len(weights))] * len(weights)  # exactly C/√k
    assert split_max_grad_norm(c, []) == []


@pytest.mark.parametrize("policy", ["per_layer", "per_matrix"])
@pytest.mark.parametrize("layers", [1, 2, 3, 6])
def test_every_policy_takes_its_bounds_from_the_one_split(policy: str, layers: int) -> None:
    net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(layers)], nn.LayerNorm(3))
    groups = make_clip_groups(policy, list(net.named_parameters()), 0.7)
    assert [g.max_norm for g in groups] == split_max_grad_norm(0.7, [1.0] * len(groups))  # bit for bit
