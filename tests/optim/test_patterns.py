"""One meaning of ``exclude`` for every optimizer (:mod:`dplightning.optim.patterns`)."""

from __future__ import annotations

import fnmatch

import pytest
from torch import nn

from dplightning.optim import DPGrape, DPMuon
from dplightning.optim import muon as muon_module
from dplightning.optim.patterns import as_fnmatch, excluded, matches

NAMES = [
    "model.lm_head.weight",
    "model.lm_head",
    "model.transformer.wte.weight",
    "model.Embed_tokens.weight",
    "encoder.layer.0.attention.self.query.weight",
    "encoder.layer.10.attention.self.query.weight",
    "classifier.out_proj.weight",
    "score",
    "shared.weight",
    "fc1.weight",
    "mix.weight",
]


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("head", "model.lm_head.weight", True),  # no wildcard: a substring
        ("head", "model.hea", False),
        ("Head", "model.lm_head.weight", True),  # case ignored
        ("*head", "model.lm_head", True),  # a wildcard: the whole name
        ("*head", "model.lm_head.weight", False),
        ("encoder.layer.0.*", "encoder.layer.0.attention.self.query.weight", True),
        ("encoder.layer.0.*", "encoder.layer.10.attention.self.query.weight", False),
        ("fc[12].weight", "fc1.weight", True),
        ("fc[12].weight", "model.fc1.weight", False),
        ("fc?", "fc1", True),
    ],
)
def test_a_pattern_matches_as_documented(pattern: str, name: str, expected: bool) -> None:
    assert matches(name, pattern) is expected


def test_a_pattern_without_a_wildcard_stands_for_star_pattern_star() -> None:
    assert as_fnmatch("head") == "*head*" and as_fnmatch("*head") == "*head" and as_fnmatch("a[0]") == "a[0]"
    for name in NAMES:
        for pattern in ("head", "embed", "layer.0", "wte"):
            assert matches(name, pattern) == matches(name, f"*{pattern}*")


@pytest.mark.parametrize("name", NAMES)
def test_dp_muons_name_fragments_keep_their_meaning(name: str) -> None:
    fragments = muon_module.DEFAULT_EXCLUDE
    before = any(x in name.lower() for x in fragments)  # DP-Muon's rule before the shared one
    assert excluded([name], fragments) == before


@pytest.mark.parametrize("pattern", ["*head*", "*classifier*", "*head", "encoder.layer.0.*", "*.query", "fc?"])
@pytest.mark.parametrize("name", NAMES)
def test_dp_grapes_wildcard_patterns_exclude_what_they_did(pattern: str, name: str) -> None:
    before = fnmatch.fnmatchcase(name, pattern)  # DP-GRAPE's rule before the shared one (module names)
    if name == name.lower():
        assert excluded([name], [pattern]) == before
    else:  # case is ignored now: what matched still does
        assert excluded([name], [pattern]) >= before


class Net(nn.Module):
    """Matrices under names the two optimizers' defaults and patterns treat differently, and a tied pair."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(12, 8)
        self.blocks = nn.ModuleDict({"Attn": nn.Linear(8, 8), "mlp_up": nn.Linear(8, 16), "mlp_down": nn.Linear(16, 8)})
        self.lm_head = nn.Linear(8, 12, bias=False)
        self.lm_head.weight = self.tok.weight  # tied: named tok.weight, owned by tok and lm_head


@pytest.mark.parametrize(
    "patterns",
    [("head",), ("*head",), ("*head*",), ("attn",), ("*Attn",), ("mlp_*",), ("blocks.mlp_up.weight",), ("up", "down")],
)
def test_dp_grape_and_dp_muon_exclude_the_same_parameters(patterns: tuple[str, ...]) -> None:
    net = Net()
    named = list(net.named_parameters())
    matrices = [(n, p) for n, p in named if n.startswith("blocks.") and p.dim() == 2]  # both may take these
    grape = DPGrape([p for _, p in named], rank=2, exclude=patterns)
    grape.dp_bind_module(net)
    muon = DPMuon([p for _, p in named], exclude=patterns)
    muon.dp_bind_module(net)
    muon.dp_plan(named, 1.0)
    by_grape = {n for n, p in matrices if not grape.selected(n, p)}
    by_muon = {n for n, p in matrices if not muon.uses_muon(p)}
    owners = {n: [m for m, mod in net.named_modules() if any(q is p for q in mod.parameters(recurse=False))]
              for n, p in named}  # fmt: skip
    assert by_grape == by_muon == {n for n, _ in matrices if excluded([n, *owners[n]], patterns)}


def test_a_tied_weight_is_excluded_through_any_module_that_owns_it() -> None:
    net = Net()
    named = list(net.named_parameters())
    muon = DPMuon([p for _, p in named], exclude=("head",))
    muon.dp_bind_module(net)
    muon.dp_plan(named, 1.0)
    assert not muon.uses_muon(net.tok.weight)  # named tok.weight; lm_head owns it too
    assert muon.uses_muon(net.blocks["Attn"].weight)


def test_without_a_bound_module_dp_muon_matches_parameter_names() -> None:
    layer = nn.Linear(4, 4)
    muon = DPMuon([layer.weight, layer.bias], exclude=("weight",))
    muon.dp_plan([("weight", layer.weight), ("bias", layer.bias)], 1.0)
    assert not muon.uses_muon(layer.weight)
