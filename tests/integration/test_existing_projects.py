"""Patterns of existing Lightning projects, run as written with ``strategy="dp"`` (issue: existing projects).

Each test is a CPU-sized version of what a third-party module does: a schedule sized by
``trainer.estimated_stepping_batches``, gradient accumulation, a GAN's two optimizers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer, params_of

ROOT = Path(__file__).resolve().parents[2]


class Warmup(TinyModule):
    """Linear decay over ``trainer.estimated_stepping_batches``, as HF fine-tuning modules size their schedule."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.estimated = self.trainer.estimated_stepping_batches
        decay = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=self.estimated)
        return [optimizer], [{"scheduler": decay, "interval": "step"}]


@pytest.mark.parametrize("k", [1, 2])
def test_estimated_stepping_batches_is_the_poisson_runs_planned_steps(k: int) -> None:
    module = Warmup()
    strategy = dp(noise_multiplier=None, target_epsilon=3.0)
    trainer = make_trainer(strategy, max_steps=-1, max_epochs=3, accumulate_grad_batches=k)
    trainer.fit(module, loader(make_dataset(70), 16))  # N not a multiple of the batch size
    assert trainer.strategy.noise_multiplier is not None  # σ calibrated for the planned steps
    assert module.estimated == trainer.strategy.steps == trainer.global_step
    assert trainer.strategy.get_epsilon() == pytest.approx(3.0, rel=0.02)


@pytest.mark.e2e
def test_estimated_stepping_batches_trains_under_python_dash_o(tmp_path) -> None:
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            """
            from tests.helpers import dp, loader, make_dataset, make_trainer
            from tests.integration.test_existing_projects import Warmup

            trainer = make_trainer(dp(noise_multiplier=1.0), max_steps=-1, max_epochs=2)
            trainer.fit(Warmup(), loader(make_dataset(70), 16))
            print("steps", trainer.strategy.steps)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-O", str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "steps 10" in run.stdout


def test_accumulation_without_poisson_sampling_averages_over_the_k_batches() -> None:
    data = DataLoader(make_dataset(32), batch_size=8, shuffle=False)
    private, plain = TinyModule(lr=1.0), TinyModule(lr=1.0)
    plain.load_state_dict(private.state_dict())
    strategy = dp(noise_multiplier=0.0, max_grad_norm=1e6, poisson_sampling=False)
    make_trainer(strategy, max_steps=1, accumulate_grad_batches=2).fit(private, data)
    make_trainer("auto", max_steps=1, accumulate_grad_batches=2).fit(plain, data)
    expected = params_of(plain)
    for name, value in params_of(private).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("poisson", "line"),
    [
        (True, "Logical batch: one Poisson sample of expected size 16 (batch_size 16 x 1 process(es), q = 0.25), "
               "split into 4 micro-batches of about 4 per process"),
        (False, "Logical batch: 4 x 16 x 1 = 64 examples per step"),
    ],
)  # fmt: skip
def test_the_logical_batch_is_said_in_one_line(poisson: bool, line: str, caplog) -> None:
    strategy = dp(noise_multiplier=1.0, poisson_sampling=poisson)
    with caplog.at_level(logging.INFO):
        make_trainer(strategy, max_steps=1, accumulate_grad_batches=4).fit(TinyModule(), loader(make_dataset(64), 16))
    assert line in caplog.text


class TwoOptimizers(TinyModule):
    """A GAN's shape: a generator and a discriminator optimizer, stepped by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


def test_a_gan_is_refused_saying_so() -> None:
    with pytest.raises(ValueError, match="GANs and other multi-optimizer setups are not supported"):
        make_trainer(dp(noise_multiplier=1.0)).fit(TwoOptimizers(), loader(make_dataset(64), 16))
