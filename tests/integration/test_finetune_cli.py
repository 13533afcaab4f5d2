"""Hugging Face fine-tuning through the CLI: a tiny random OPT under dp_ddp on 2 CPU processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path) -> Path:
    data = tmp_path / "train.jsonl"
    words = "the pub serves cheap food near the river in the city centre with a view".split()
    rows = [{"prompt": f"name[V{i}] =", "completion": " " + " ".join(words[i % 5 : i % 5 + 6])} for i in range(96)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "devices": 2, "max_steps": 3, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
            "default_root_dir": str(tmp_path / "run"),
            "strategy": {"class_path": "dplightning.DPDDPStrategy",
                         "init_args": {"noise_multiplier": 1.0, "max_grad_norm": 0.5, "process_group_backend": "gloo"}},
            "callbacks": [{"class_path": "tests.helpers.DumpRankState", "init_args": {"folder": str(tmp_path)}}],
        },
        "model": {"class_path": "dplightning.tasks.DPCausalLM",
                  "init_args": {"config": {"model_type": "opt", "num_hidden_layers": 1, "num_attention_heads": 2,
                                           "hidden_size": 16, "ffn_dim": 32, "word_embed_proj_dim": 16,
                                           "max_position_embeddings": 64, "vocab_size": 300}}},
        "data": {"class_path": "dplightning.data.TextFileDataModule",
                 "init_args": {"train": str(data), "vocab_size": 300, "max_length": 64, "batch_size": 8}},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_tiny_opt_fine_tunes_under_dp_ddp_through_the_cli(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "dplightning.cli", "fit", "--config", str(_config(tmp_path))],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Final privacy guarantee: (ε = " in run.stdout + run.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 3 and ranks[0]["epsilon"] == ranks[1]["epsilon"] > 0
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name  # bitwise identical
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()  # trained once, shared by the ranks
