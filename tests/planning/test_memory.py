"""The memory planner: exact counts from instantiated models, monotonicity, units, the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

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
        "model": {"class_path": "dplightning.modules.DPCausalLM", "init_args": init},
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

    from dplightning.modules import DPCausalLM

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
    from dplightning.modules import DPCausalLM
    from dplightning.optim import DPGrape

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
