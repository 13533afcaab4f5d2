"""The 2-node recipe: the cluster overlay composed with task configs, as the CLI's parser merges them.

The overlay must change the cluster layout only. Every DP argument of the task config must survive
the merge (a DP argument in the overlay would silently replace the task's), and the recipe the launch
scripts run by default (the quickstart on 2 x 8 processes) must have a Poisson rate q <= 1.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from contextlib import redirect_stdout
from dataclasses import fields
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml

from dplightning.cli import build_cli
from dplightning.data import DigitsDataModule
from dplightning.strategies.config import DPConfig

ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "configs" / "cluster"
OVERLAY = CLUSTER / "dp_ddp_2x8gpu.yaml"
DP_ARGUMENTS = [f.name for f in fields(DPConfig)]


def _task_configs() -> list[Path]:
    """Every shipped config that sets its own DP strategy (the files an overlay is layered on)."""
    found = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        content = yaml.safe_load(path.read_text()) or {}
        strategy = (content.get("trainer") or {}).get("strategy")
        if path.parent != CLUSTER and isinstance(strategy, dict) and "init_args" in strategy:
            found.append(path)
    return found


def _resolved(args: list[str]) -> dict[str, Any]:
    """The config the CLI would run with, from its own parser (``--print_config``)."""
    printed = StringIO()
    with pytest.raises(SystemExit) as exit_info, redirect_stdout(printed):
        build_cli([*args, "--print_config"])
    assert exit_info.value.code == 0, printed.getvalue()[-2000:]
    return yaml.safe_load(printed.getvalue())


def _dp_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """The strategy's DP arguments (``DPStrategy`` has no ``noise_placement``; ``DPDDPStrategy`` has)."""
    init_args = config["trainer"]["strategy"]["init_args"]
    return {name: init_args[name] for name in DP_ARGUMENTS if name in init_args}


def test_overlay_names_no_dp_argument() -> None:
    strategy = yaml.safe_load(OVERLAY.read_text())["trainer"]["strategy"]
    assert set(strategy.get("init_args") or {}).isdisjoint(DP_ARGUMENTS)


TASKS = _task_configs()


@pytest.mark.parametrize("task", TASKS, ids=[str(t.relative_to(ROOT / "configs")) for t in TASKS])
def test_overlay_keeps_the_task_configs_dp_arguments(task: Path) -> None:
    alone = _resolved(["fit", "--config", str(task)])
    layered = _resolved(["fit", "--config", str(task), "--config", str(OVERLAY)])
    assert layered["trainer"]["strategy"]["class_path"] == "dplightning.DPDDPStrategy"
    assert (layered["trainer"]["num_nodes"], layered["trainer"]["devices"]) == (2, 8)
    assert _dp_arguments(alone) and _dp_arguments(alone).items() <= _dp_arguments(layered).items()


def test_class_path_override_keeps_the_dp_arguments() -> None:
    """The documented command-line switch to dp_ddp (docs/multi_gpu_and_multi_node.md)."""
    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    alone = _resolved(["fit", "--config", quickstart])
    switched = _resolved(["fit", "--config", quickstart, "--trainer.strategy.class_path", "dplightning.DPDDPStrategy"])
    assert switched["trainer"]["strategy"]["class_path"] == "dplightning.DPDDPStrategy"
    assert _dp_arguments(alone) and _dp_arguments(alone).items() <= _dp_arguments(switched).items()


def _launched_command(script: Path, launcher: str, tmp_path: Path) -> list[str]:
    """The dplightning arguments a launch script runs with no arguments of its own (launcher stubbed)."""
    record = tmp_path / "argv"
    stub = tmp_path / "bin" / launcher
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {shlex.quote(str(record))}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}", "NODE_RANK": "0"}
    env["MASTER_ADDR"] = "127.0.0.1"
    subprocess.run(["bash", str(script)], cwd=ROOT, env=env, check=True, timeout=60)
    argv = record.read_text().splitlines()
    return argv[argv.index("fit") :]


@pytest.mark.parametrize(("script", "launcher"), [("slurm_2x8gpu.sbatch", "srun"), ("torchrun_2x8gpu.sh", "torchrun")])
def test_launch_scripts_run_the_quickstart_with_q_at_most_one(script: str, launcher: str, tmp_path: Path) -> None:
    if sys.platform == "win32":
        pytest.skip("bash scripts")
    config = _resolved(_launched_command(CLUSTER / script, launcher, tmp_path))
    world_size = config["trainer"]["num_nodes"] * config["trainer"]["devices"]
    data = DigitsDataModule(**config["data"]["init_args"])
    data.setup("fit")
    q = config["data"]["init_args"]["batch_size"] * world_size / len(data.train_set)
    assert world_size == 16 and q <= 1
    quickstart = _resolved(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml")])
    assert _dp_arguments(quickstart).items() <= _dp_arguments(config).items()


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_overlay_runs_on_two_cpu_processes(tmp_path: Path) -> None:
    """The recipe's CPU version (docs/multi_gpu_and_multi_node.md), one epoch: Lightning starts 2 gloo ranks."""
    args = [
        "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--config", str(OVERLAY),
        "--trainer.accelerator", "cpu", "--trainer.num_nodes", "1", "--trainer.devices", "2",
        "--trainer.precision", "32-true", "--trainer.strategy.init_args.process_group_backend", "gloo",
        "--data.init_args.batch_size", "128", "--trainer.max_epochs", "1", "--test_after_fit", "false",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "dplightning.cli", *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    # the quickstart's q (128 x 2 / 1,258), C and accountant; σ calibrated for ε = 3 over this run's 5 steps
    assert "q = 0.2035, C = 1.0" in out and "accountant = prv" in out and "(ε = 2.9" in out
