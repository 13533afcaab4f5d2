"""The memory planner: exact counts from instantiated models, monotonicity, units, the CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dplightning.optim import DPGrape
from dplightning.planning.memory import (
    GB,
    assemble,
    load_configs,
    main,
    parse_memory,
    physical_batch,
    plan,
    survey,
)
from dplightning.privacy.grad_sample import SlotTransform

TINY_OPT = {
    "model_type": "opt",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "ffn_dim": 64,
    "word_embed_proj_dim": 32,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def fit_config(lora: dict[str, Any] | None = None, batch_size: int = 8, optimizer: Any = None) -> dict[str, Any]:
    init: dict[str, Any] = {"config": dict(TINY_OPT)}
    if lora is not None:
        init["lora"] = lora
    if optimizer is not None:
        init["optimizer"] = optimizer
    return {
        "trainer": {
            "accelerator": "cpu",
            "strategy": {"class_path": "dplightning.DPStrategy", "init_args": {"noise_multiplier": 1.0}},
        },
        "model": {"class_path": "dplightning.tasks.DPCausalLM", "init_args": init},
        "data": {
            "class_path": "dplightning.data.E2EDataModule",
            "init_args": {"batch_size": batch_size, "max_length": 32},
        },
    }


def component(p: Any, name: str) -> float:
    return next(c.bytes for c in p.components if c.name == name)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_counts_equal_the_instantiated_module(lora: dict[str, Any] | None) -> None:
    import torch

    from dplightning.tasks import DPCausalLM

    module = DPCausalLM(config=dict(TINY_OPT), lora=lora)
    optimizer = module.configure_optimizers()
    total = sum(p.numel() for p in module.parameters())
    trainable = module.trainable_parameters()
    p = plan(fit_config(lora))
    assert (p.parameters, p.trainable) == (total, trainable)
    assert component(p, "weights") == 4 * total
    assert component(p, "DP buckets (clipped sum)") == 4 * trainable
    # AdamW's states, once created by a step: 2 fp32 tensors per trainable parameter (its `step` counters aside)
    for q in optimizer.param_groups[0]["params"]:
        q.grad = torch.zeros_like(q)
    optimizer.step()
    states = sum(t.numel() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    assert component(p, "optimizer states") == 4 * states


def test_sgd_momentum_has_one_state_and_plain_sgd_none() -> None:
    momentum = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}}
    plain = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}
    p_m, p_0 = plan(fit_config(optimizer=momentum)), plan(fit_config(optimizer=plain))
    assert component(p_m, "optimizer states") == 4 * p_m.trainable
    assert component(p_0, "optimizer states") == 0


def test_more_batch_more_activations_and_lora_needs_less() -> None:
    sv = survey(fit_config())
    small, large = assemble(sv), assemble(survey(fit_config(batch_size=64)))
    assert component(large, "activations") > component(small, "activations")
    assert large.peak > small.peak
    lora = plan(fit_config(LORA))
    for name in ("optimizer states", "DP buckets (clipped sum)", "gradients p.grad"):
        assert component(lora, name) < component(small, name)
    assert lora.trainable < small.trainable


def test_accumulation_splits_the_poisson_batch() -> None:
    assert physical_batch(64, 1, 0.0, True) == 64
    assert physical_batch(64, 4, 4.0, True) == 24  # ceil((64 + 4 * 8) / 4)
    assert physical_batch(64, 4, 4.0, False) == 16  # fixed batches: no margin
    sv = survey(fit_config(batch_size=64))
    assert assemble(sv, accumulate=4).peak < assemble(sv).peak


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GB", 80e9), ("80GiB", 80 * 2**30), ("24G", 24e9), ("512MiB", 512 * 2**20), ("40", 40e9), ("1.5 TB", 1.5e12)],
)
def test_parse_memory(text: str, expected: float) -> None:
    assert parse_memory(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["80XB", "-3GB", "GB", ""])
def test_parse_memory_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError):
        parse_memory(text)


def test_fits_decision() -> None:
    p = plan(fit_config())
    assert p.fits(p.peak) and not p.fits(p.peak - 1)
    assert not p.fits(p.peak, reserve=1.0)


def write(tmp_path: Path, name: str, data: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_table_json_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "tiny.yaml", fit_config())
    assert main(["--config", config, "--gpu-memory", "80GB"]) == 0
    text = capsys.readouterr().out
    assert "activations" in text and "FITS" in text
    assert main(["--config", config, "--gpu-memory", "1MiB", "--reserve", "0GB", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["peak_bytes"] > 2**20 and out["suggestion"].startswith("does not fit")
    assert {c["name"] for c in out["components"]} >= {"weights", "optimizer states", "activations"}
    assert main(["--config", config, "--gpu-memory", "lots"]) == 2


def test_later_configs_override_earlier_ones(tmp_path: Path) -> None:
    base = write(tmp_path, "base.yaml", fit_config())
    overlay = write(tmp_path, "overlay.yaml", {"trainer": {"precision": "bf16-true", "accumulate_grad_batches": 2}})
    merged = load_configs([base, overlay])
    assert merged["trainer"]["strategy"]["class_path"] == "dplightning.DPStrategy"  # kept from the base
    p = plan(merged)
    assert p.precision == "bf16-true" and p.accumulate == 2
    assert component(p, "weights") == 2 * p.parameters


def test_published_opt_6_7b_counts_6_7_billion() -> None:
    config = fit_config()
    config["model"]["init_args"] = {
        "pretrained": "facebook/opt-6.7b",
        "lora": {"r": 16, "target_modules": ["q_proj", "v_proj"]},
    }
    p = plan(config)
    assert abs(p.parameters - 6.7e9) / 6.7e9 < 0.01
    assert "published config" in p.model_source
    assert p.trainable == 32 * 2 * 16 * (4096 + 4096)  # rank-16 A and B on q and v of 32 layers
    assert p.peak > p.parameters * 4  # at least the fp32 weights
    assert p.peak / GB < 200


def test_dp_grape_plans_its_slots_for_states_and_buckets() -> None:
    from dplightning.optim import DPGrape
    from dplightning.tasks import DPCausalLM

    module = DPCausalLM(config=dict(TINY_OPT))
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    opt = DPGrape([p for _, p in named], rank=4)
    opt.dp_bind_module(module)
    transforms = opt.dp_plan(named, 1.0).transforms
    slots = sum(transforms[p].slot_shape(p.shape).numel() if p in transforms else p.numel() for _, p in named)
    assert transforms and slots < sum(p.numel() for _, p in named)
    grape = plan(fit_config(optimizer={"class_path": "dplightning.optim.DPGrape", "init_args": {"rank": 4}}))
    assert component(grape, "DP buckets (clipped sum)") == 4 * slots
    assert component(grape, "optimizer states") == 2 * 4 * slots  # two fp32 moments per slot element
    adam = plan(fit_config())
    assert component(grape, "formed per-example gradients") < component(adam, "formed per-example gradients")
    assert grape.peak < adam.peak


class QueriesOnly(DPGrape):
    """A DP-GRAPE under another name whose plan projects the query weights only (a plan of its own)."""

    def dp_plan(self, named_params: Any, max_grad_norm: float) -> Any:
        plan = super().dp_plan(named_params, max_grad_norm)
        names = {p: n for n, p in named_params}
        return replace(plan, transforms={p: t for p, t in plan.transforms.items() if "q_proj" in names[p]})


class Unrolled(SlotTransform):
    """A slot transform that is no projection (it only reshapes)."""

    def slot_shape(self, shape: Any) -> Any:
        return torch.Size((math.prod(shape),))

    def dense(self, grads: Any) -> Any:
        return grads.flatten(-2)

    def factored(self, grad: Any) -> Any:
        raise NotImplementedError


class UnrollsWeights(DPGrape):
    def dp_plan(self, named_params: Any, max_grad_norm: float) -> Any:
        plan = super().dp_plan(named_params, max_grad_norm)
        return replace(plan, transforms={p: Unrolled() for p in plan.transforms})


def _slots_of(config: dict[str, Any]) -> tuple[int, set[str]]:
    sv = survey(config)
    return sv.slots or 0, set(sv.projected)


def test_the_slots_are_the_optimizers_own_dp_plan_whatever_its_name() -> None:
    grape = survey(fit_config(optimizer={"class_path": "dplightning.optim.DPGrape", "init_args": {"rank": 4}}))
    mine = survey(fit_config(optimizer={"class_path": f"{__name__}.QueriesOnly", "init_args": {"rank": 4}}))
    assert set(mine.projected) == {n for n in grape.projected if n.endswith("q_proj")} and mine.projected
    weights = {layer.name: layer.weight for layer in grape.layers}
    unprojected = sum(weights[n] - grape.projected[n].slot for n in set(grape.projected) - set(mine.projected))
    assert mine.slots == (grape.slots or 0) + unprojected  # the other weights keep their full slots


def test_init_args_are_typed_as_the_fit_types_them_and_unknown_ones_are_refused() -> None:
    as_yaml_reads_it = {"class_path": "dplightning.optim.DPGrape", "init_args": {"lr": "2e-4", "rank": "4"}}
    assert _slots_of(fit_config(optimizer=as_yaml_reads_it)) == _slots_of(
        fit_config(optimizer={"class_path": "dplightning.optim.DPGrape", "init_args": {"lr": 2e-4, "rank": 4}})
    )
    with pytest.raises(ValueError, match="do not fit DPGrape"):
        survey(fit_config(optimizer={"class_path": "dplightning.optim.DPGrape", "init_args": {"rnak": 4}}))


def test_a_plan_without_projections_and_a_transform_the_planner_cannot_model() -> None:
    muon = survey(fit_config(optimizer={"class_path": "dplightning.optim.DPMuon"}))
    assert muon.slots is None and not muon.projected  # DP-Muon's plan transforms no slot
    with pytest.raises(ValueError, match="the DP plan transforms .* with a Unrolled"):
        survey(fit_config(optimizer={"class_path": f"{__name__}.UnrollsWeights", "init_args": {"rank": 4}}))


# ---------------------------------------------------------------- the optimizer's state, asked of it or stepped on meta

# The class-name table the planner had before it asked the optimizer (states per trainable parameter, in the
# weights' dtype): stepping torch's optimizers on meta tensors must give the same.
TORCH_TABLE = [
    ("torch.optim.Adam", {}, 2),
    ("torch.optim.AdamW", {"lr": "2e-4", "weight_decay": 0.0}, 2),
    ("torch.optim.AdamW", {"amsgrad": True}, 3),
    ("torch.optim.SGD", {"lr": 0.1}, 0),
    ("torch.optim.SGD", {"lr": 0.1, "momentum": 0.9}, 1),
    ("torch.optim.RMSprop", {}, 1),
    ("torch.optim.RMSprop", {"momentum": 0.9}, 2),
    ("torch.optim.RMSprop", {"momentum": 0.9, "centered": True}, 3),
    ("torch.optim.Adagrad", {}, 1),
    ("torch.optim.Adadelta", {}, 2),
    ("torch.optim.NAdam", {}, 2),
    ("torch.optim.RAdam", {}, 2),
    ("torch.optim.Adamax", {}, 2),
]


def _with_precision(config: dict[str, Any], precision: str) -> dict[str, Any]:
    return {**config, "trainer": {**config["trainer"], "precision": precision}}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize(("path", "args", "states"), TORCH_TABLE, ids=lambda v: str(v))
def test_torch_optimizers_stepped_on_meta_give_the_former_table(path: str, args: dict, states: int, precision: str):
    p = plan(_with_precision(fit_config(optimizer={"class_path": path, "init_args": args}), precision))
    weight_bytes = 4 if precision == "32-true" else 2
    assert p.optimizer_states == states
    assert component(p, "optimizer states") == states * p.trainable * weight_bytes
    assert next(c.note for c in p.components if c.name == "optimizer states") == f"{states} per trainable parameter"
    assert not [n for n in p.notes if n.startswith("optimizer state")]


class HeavyBall(torch.optim.SGD):
    """SGD with momentum under a name no table knows: one state per parameter, found from the step."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr, momentum=0.9)


def test_the_state_is_found_by_stepping_not_by_the_class_name() -> None:
    p = plan(fit_config(optimizer={"class_path": f"{__name__}.HeavyBall"}))
    assert (p.optimizer_states, component(p, "optimizer states")) == (1, 4 * p.trainable)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("args", [{}, {"matrix_update": "adamw"}, {"exclude": ["embed", "head", "fc"]}])
def test_dp_muon_is_planned_from_its_declared_fp32_state(args: dict[str, Any], precision: str) -> None:
    from dplightning.optim import DPMuon
    from dplightning.tasks import DPCausalLM

    module = DPCausalLM(config=dict(TINY_OPT))
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    opt = DPMuon([p for _, p in named], **args)
    opt.dp_bind_module(module)
    opt.dp_plan(named, 1.0)
    muon = sum(p.numel() for _, p in named if opt.uses_muon(p)) if not args.get("matrix_update") else 0
    expected = 4 * (muon + 2 * (sum(p.numel() for _, p in named) - muon))  # fp32 momentum; fp32 AdamW moments
    config = fit_config(optimizer={"class_path": "dplightning.optim.DPMuon", "init_args": args})
    p = plan(_with_precision(config, precision))
    assert component(p, "optimizer states") == expected
    assert p.optimizer_states == pytest.approx(expected / 4 / p.trainable, abs=1e-3)
    note = next(c.note for c in p.components if c.name == "optimizer states")
    assert ("fp32" in note) == (precision == "bf16-true")  # named when it is not the weights' dtype


@pytest.mark.parametrize(
    ("path", "why"),
    [("torch.optim.ASGD", "ASGD cannot step on meta tensors"), ("no_such_package.Lamb", "could not be imported")],
)
def test_an_optimizer_that_cannot_step_on_meta_is_planned_as_adam_and_the_plan_says_so(path: str, why: str) -> None:
    p = plan(fit_config(optimizer={"class_path": path}))
    assert (p.optimizer_states, component(p, "optimizer states")) == (2, 2 * 4 * p.trainable)
    assert any(n.startswith("optimizer state: ") and why in n and "planned as Adam's" in n for n in p.notes)


@pytest.mark.parametrize(
    ("path", "args", "states"),
    [("torch.optim.AdamW", {"amsgrad": True}, 3), ("SGD", {"lr": 0.1}, 0), ("dplightning.optim.DPMuon", {}, 1)],
)
def test_optimizer_states_still_answers_per_element_of_a_matrix(path: str, args: dict[str, Any], states: int) -> None:
    from dplightning.planning.memory import optimizer_states

    assert optimizer_states(path, args) == states


# ---------------------------------------------------------------- the engines' rules and DP defaults, read not retyped


def _engine_decisions(model: Any, x: Any, engine: str) -> dict[str, bool]:
    """Per hooked weight, whether the engine really kept this call factored."""
    from dplightning.privacy.grad_sample import Factored, PerExampleHooks

    hooks = PerExampleHooks(model, list(model.parameters()), engine=engine, functorch_fallback=True)
    try:
        model(x).float().square().sum().backward()
        grads = hooks.pop()
    finally:
        hooks.close()
    return {name: isinstance(grads[m.weight], Factored) for name, m in model.named_children()}


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("engine", ["auto", "book_keeping", "instantiate"])
def test_the_plan_and_the_engines_agree_on_every_layer_and_call(engine: str, tokens: int) -> None:
    import torch
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from dplightning.planning.memory import hooked_layers
    from tests.privacy.test_engines import _OwnForward

    torch.manual_seed(0)
    widths = [(4, 8), (8, 3), (3, 11), (11, 16)]  # a·b = 32, 24, 33, 176: the rule's boundary for T in 3..9
    layers = [nn.Linear(4, 8), Conv1D(3, 8), _OwnForward(3, 11), nn.Linear(11, 16)]
    model = nn.Sequential(*layers)
    planned = {x.name: x.factored(engine, tokens) for x in hooked_layers(model)}
    assert planned == _engine_decisions(model, torch.randn(5, tokens, 4), engine)
    assert [x.in_width for x in hooked_layers(model)] == [a for a, _ in widths]
    ids = nn.Sequential(nn.Embedding(4, 5), nn.Linear(5, 2))  # 20 and 10 entries
    planned = {x.name: x.factored(engine, tokens) for x in hooked_layers(ids)}
    assert planned == _engine_decisions(ids, torch.randint(0, 4, (5, tokens)), engine)


def test_a_registered_factorisation_is_planned_as_factored(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from dplightning.planning.memory import hooked_layers
    from dplightning.privacy.grad_sample import engines
    from tests.privacy.test_engines import IN_OUT, InOut

    model = nn.Sequential(InOut(6, 4))
    before = hooked_layers(model)[0]
    assert (before.kind, before.factorable) == ("other", False)
    monkeypatch.setattr(engines, "_FACTORISATIONS", dict(engines._FACTORISATIONS))
    engines.register_factorisation(IN_OUT)
    after = hooked_layers(model)[0]
    assert (after.kind, after.in_width, after.out_width, after.factorable) == ("linear", 6, 4, True)


def test_the_dp_defaults_are_dp_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import dataclass

    from dplightning.planning.memory import settings_of
    from dplightning.strategies import config

    @dataclass(frozen=True)
    class Changed(config.DPConfig):  # every default the planner reads, changed
        clipping: str = "per_layer"
        clipping_engine: str = "book_keeping"
        poisson_sampling: bool = False
        verify_gradients: str = "never"  # type: ignore[assignment]
        bucket_cap_mb: float = 7.0
        noise_mechanism: str = "band_mf"  # type: ignore[assignment]
        bands: int | None = 3

    monkeypatch.setattr(config, "DPConfig", Changed)
    s = settings_of({})
    assert (s.clipping, s.engine, s.poisson, s.verify, s.bucket_cap_mb) == (
        "per_layer",
        "book_keeping",
        False,
        "never",
        7,
    )
    assert s.noise_buffers == 2  # bands - 1
    given = settings_of({"trainer": {"strategy": {"init_args": {"clipping": "flat", "bands": 5}}}})
    assert (given.clipping, given.noise_buffers) == ("flat", 4)


def test_an_unknown_engine_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = fit_config()
    config["trainer"]["strategy"]["init_args"]["clipping_engine"] = "ghost"
    assert main(["--config", write(tmp_path, "typo.yaml", config)]) == 2
    assert "Unknown clipping_engine 'ghost'" in capsys.readouterr().err


def _strategy(config: dict[str, Any], **args: Any) -> dict[str, Any]:
    config["trainer"]["strategy"]["init_args"].update(args)
    return config


def test_clip_replay_plans_the_retained_graph_and_one_layers_factors_beside_the_shared_weight() -> None:
    steady = dict(verify_gradients="never", clipping_engine="book_keeping")
    one_pass = plan(_strategy(fit_config(), **steady))
    replay = plan(_strategy(fit_config(), clip_replay=True, **steady))
    deltas = "output gradients kept (Δ)"
    # One pass keeps every layer's Δ to the clip point; the replay only the tied head's and one other layer's.
    head = replay.physical_batch * replay.tokens * TINY_OPT["vocab_size"] * 4
    assert head < component(replay, deltas) < component(one_pass, deltas) - head // 2
    # The first pass keeps the whole graph (every activation and the loss' log-softmax) for the second.
    assert component(replay, "activations kept for the replay") == component(replay, "activations") + head
    assert all(c.name != "layer inputs held by the hooks (A)" for c in replay.components)
    assert any("clip_replay" in n for n in replay.notes)


@pytest.mark.parametrize(
    "args", [{}, {"clipping": "per_layer", "verify_gradients": "never"}], ids=["verified", "per_layer"]
)
def test_clip_replay_changes_no_plan_where_it_does_not_replay(args: dict[str, Any]) -> None:
    """Verified steps hold as in one pass (and are the peak); layer-local groups are never replayed."""
    without = plan(_strategy(fit_config(), **args))
    with_replay = plan(_strategy(fit_config(), clip_replay=True, **args))
    assert with_replay.components == without.components
