"""configs/grape: each GPU config is its DP-Adam config with only the optimizer switched to DPGrape.

DPGrape's default P ~ N(0, 1/r) keeps each example's gradient norm and AdamW's update scale, so
DP-Adam's lr and C carry over (docs/dp_grape.md); a GPU config that took the authors' lr or C
(tuned for P ~ N(0, 1/r²)) while keeping the default P would be neither their run nor a tuned one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAIRS = {
    "sst2_roberta-large_dp_grape_gpu.yaml": "sst2_roberta-large_gpu.yaml",
    "e2e_opt-1.3b_dp_grape_gpu.yaml": "e2e_opt-1.3b_full_gpu.yaml",
    "e2e_opt-2.7b_dp_grape_gpu.yaml": "e2e_opt-2.7b_full_gpu.yaml",
    "e2e_opt-6.7b_dp_grape_gpu.yaml": "e2e_opt-6.7b_full_gpu.yaml",
}


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _without_optimizer_and_logs(config: dict[str, Any]) -> dict[str, Any]:
    config = yaml.safe_load(yaml.safe_dump(config))
    config["model"]["init_args"].pop("optimizer")
    config["trainer"].pop("default_root_dir", None)
    # Memory only: micro-batches change neither the expected batch nor q (OPT-6.7B needs 8 to fit).
    config["trainer"].pop("accumulate_grad_batches", None)
    return config


def test_every_gpu_config_of_the_folder_is_paired() -> None:
    gpu = {p.name for p in (ROOT / "configs" / "grape").glob("*_gpu.yaml")}
    assert gpu == set(PAIRS)


@pytest.mark.parametrize(("grape", "adam"), sorted(PAIRS.items()))
def test_a_gpu_config_switches_only_the_optimizer_and_keeps_dp_adams_lr_and_clip(grape: str, adam: str) -> None:
    mine, base = _load(ROOT / "configs" / "grape" / grape), _load(ROOT / "configs" / "finetune" / adam)
    assert _without_optimizer_and_logs(mine) == _without_optimizer_and_logs(base)
    optimizer = mine["model"]["init_args"]["optimizer"]
    assert optimizer["class_path"] == "dplightning.optim.DPGrape"
    args = optimizer["init_args"]
    assert args.get("projection_std", "jl") == "jl" and args.get("scale", 1.0) == 1.0
    assert args["lr"] == base["model"]["init_args"]["optimizer"]["init_args"]["lr"]
    assert (args["rank"], args["refresh_every"]) == (16, 100)  # the authors' r and T
