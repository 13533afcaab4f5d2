"""Multi-node launch paths on CPU: torchrun and SLURM, with the variables they set.

Two "nodes" of one process each run on localhost; the CLI trains the quickstart for
one epoch with ``dp_ddp`` over gloo. The global sampling rate must be
batch_size x world_size / N on both paths.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.e2e, pytest.mark.timeout(300)]

CONFIG = str(Path(__file__).parents[2] / "configs" / "quickstart.yaml")
CLI_ARGS = [
    "fit", "--config", CONFIG, "--trainer.strategy", "dp_ddp", "--trainer.accelerator", "cpu",
    "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.max_epochs", "1", "--test_after_fit", "false",
]  # fmt: skip
EXPECTED_Q = f"q = {256 * 2 / 1258:.4g}"  # quickstart batch 256 per process, 2 processes, 1,258 training images


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_nodes(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[str]:
    procs = [
        subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd, env in zip(commands, envs)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def _base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))
    }
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


def test_torchrun_two_nodes(tmp_path: Path) -> None:
    port = str(_free_port())
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(r),
         "--master_addr", "127.0.0.1", "--master_port", port, "-m", "dplightning.cli", *CLI_ARGS]
        for r in range(2)
    ]  # fmt: skip
    outputs = _run_nodes(commands, [_base_env(), _base_env()], tmp_path)
    joined = "\n".join(outputs)
    assert "Final privacy guarantee" in joined and EXPECTED_Q in joined


def test_slurm_two_nodes(tmp_path: Path) -> None:
    port = str(_free_port())
    envs = []
    for rank in range(2):
        env = _base_env()
        env.update(
            SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID=str(rank), SLURM_LOCALID="0",
            SLURM_NODEID=str(rank), SLURM_JOB_ID="4242", SLURM_JOB_NAME="dplightning", SLURM_NODELIST="127.0.0.1",
            MASTER_PORT=port,
        )  # fmt: skip
        envs.append(env)
    outputs = _run_nodes([[sys.executable, "-m", "dplightning.cli", *CLI_ARGS]] * 2, envs, tmp_path)
    joined = "\n".join(outputs)
    assert "Final privacy guarantee" in joined and EXPECTED_Q in joined
