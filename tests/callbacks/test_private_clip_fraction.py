"""PrivateClipFraction: its cost is accounted as one Gaussian mechanism with σ_eff, and its noise is right."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

import dplightning
from dplightning.callbacks import PrivateClipFraction
from dplightning.privacy.noise import GaussianNoise, derive_seed
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

N, BATCH = 256, 4  # q = 1/64
Q, DELTA = BATCH / N, 1 / (10 * N)


def _sigma_eff(sigma: float, sigma_b: float) -> float:
    return 1 / math.sqrt(sigma**-2 + sigma_b**-2)


@pytest.mark.parametrize(("name", "cls"), [("prv", PRVAccountant), ("rdp", RDPAccountant)])
def test_epsilon_is_that_of_one_gaussian_mechanism_with_sigma_eff(name: str, cls: type) -> None:
    sigma, sigma_b = 1.0, 3.0
    trainer = make_trainer(dp(noise_multiplier=sigma, accountant=name), callbacks=[PrivateClipFraction(sigma_b)],
                           max_steps=5)  # fmt: skip
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    strategy = trainer.strategy.dp_state
    assert strategy.noise_multiplier == sigma and strategy.noise_std == sigma * strategy.max_grad_norm
    assert strategy.ledger.history == ((pytest.approx(_sigma_eff(sigma, sigma_b), rel=1e-15), Q, 5),)
    reference = cls()
    reference.history = [(_sigma_eff(sigma, sigma_b), Q, 5)]
    assert strategy.get_epsilon() == pytest.approx(reference.get_epsilon(delta=DELTA), rel=1e-12)
    without = cls()
    without.history = [(sigma, Q, 5)]
    assert strategy.get_epsilon() > without.get_epsilon(delta=DELTA)  # the count is not free


def test_target_epsilon_calibrates_sigma_eff_and_the_gradient_gets_the_rest() -> None:
    sigma_b, steps = 4.0, 6
    strategy = dplightning.DPStrategy(target_epsilon=1.0, accountant="rdp")
    trainer = make_trainer(strategy, callbacks=[PrivateClipFraction(sigma_b)], max_steps=steps)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    expected_eff = get_noise_multiplier(target_epsilon=1.0, target_delta=DELTA, sample_rate=Q, steps=steps,
                                        accountant="rdp", epsilon_tolerance=0.01)  # fmt: skip
    state = strategy.dp_state
    assert state.accounted_noise_multiplier == pytest.approx(expected_eff, rel=1e-12)
    assert _sigma_eff(state.noise_multiplier, sigma_b) == pytest.approx(expected_eff, rel=1e-12)
    assert state.noise_multiplier > expected_eff
    assert 0.95 < strategy.get_epsilon() <= 1.0


def test_count_noise_is_one_draw_of_the_documented_stream_per_step() -> None:
    sigma_b, steps = 2.5, 200
    callback = PrivateClipFraction(sigma_b, seed=11)
    trainer = make_trainer(dp(noise_multiplier=1.0, accountant="gdp", seed=2), callbacks=[callback], max_steps=steps)
    trainer.fit(TinyModule(zero_loss=True), loader(make_dataset(N), BATCH))  # zero gradients: nothing is clipped
    noise = np.array(callback.noisy_counts)
    assert len(noise) == steps
    # Statistical: mean 0 and std σ_b (one draw per step, not several).
    assert abs(noise.mean()) < 5 * sigma_b / math.sqrt(steps)
    assert abs(noise.std() / sigma_b - 1) < 5 / math.sqrt(2 * steps)
    # Exact: the stream of derive_seed(seed, "clip_count") at each step, independent of the gradient's stream.
    expected = []
    for step in range(steps):
        stream = GaussianNoise(derive_seed(11, "clip_count"), rank=0)
        stream.start_step(step)
        expected.append(stream.sample(torch.zeros((), dtype=torch.float64), sigma_b).item())
    assert noise.tolist() == pytest.approx(expected, abs=1e-12)
    logged = trainer.callback_metrics["private/clip_fraction"].item()
    assert logged == pytest.approx(noise[-1] / trainer.strategy.dp_state.expected_batch_size, rel=1e-6)


def test_rejects_a_count_noise_that_alone_exceeds_the_budget() -> None:
    strategy = dplightning.DPStrategy(target_epsilon=1.0, accountant="rdp")
    trainer = make_trainer(strategy, callbacks=[PrivateClipFraction(0.5)], max_steps=6)
    with pytest.raises(ValueError, match="alone exceed"):
        trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))


def test_registering_after_calibration_raises() -> None:
    strategy = dplightning.DPStrategy(target_epsilon=1.0, accountant="rdp")
    make_trainer(strategy, max_steps=1).fit(TinyModule(), loader(make_dataset(N), BATCH))
    with pytest.raises(RuntimeError, match="before fit starts"):
        strategy.register_step_release("late", 5.0)


def test_rejects_bad_noise_and_non_dp_strategies() -> None:
    with pytest.raises(ValueError, match="finite and > 0"):
        PrivateClipFraction(0.0)
    with pytest.raises(TypeError, match="strategy='dp'"):
        make_trainer("auto", callbacks=[PrivateClipFraction(1.0)]).fit(TinyModule(), loader(make_dataset(N), BATCH))
