"""Correlated-noise mechanisms (``noise_mechanism="band_mf"`` / ``"blt"``) through a real Trainer.

References are built independently of the strategy's wiring: the clipped mean by torch.func,
the noise by regenerating the documented white-noise streams and solving C z = w densely
(scipy, float64) with C rebuilt from its public coefficients in numpy, the sensitivities by
brute force over every participation pattern, ε by Opacus' accountants given the equivalent
DP-SGD parameters computed here, by Google's dp_accounting given JAX-Privacy's events, and the
un-amplified Gaussian by its closed form.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy.optimize import brentq
from scipy.stats import norm
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import dplightning
from dplightning.callbacks import PrivacyBudget
from dplightning.commands.export import load_checkpoint, privacy_of
from dplightning.commands.report import format_report, privacy_report
from dplightning.privacy.matrix_mechanism import Workload, optimize_banded, sensitivity_brute_force
from dplightning.privacy.noise import GaussianNoise, derive_seed
from dplightning.protocols import DPRelease
from dplightning.strategies._dp import CHECKPOINT_KEY
from dplightning.strategies.accounting import InconsistentLedger, check_ledger
from examples.dp_plan_optimizer import ProjectedSGD
from tests.helpers import DEVICE, TinyModule, loader, make_dataset, make_trainer, mlp, params_of
from tests.reference import clipped_sum, per_example_grads

N, BATCH = 48, 4


def strategy(**kwargs: Any) -> dplightning.DPStrategy:
    kwargs.setdefault("noise_multiplier", 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sigma = 0 warns by design
        return dplightning.DPStrategy(**kwargs)


class _Track(pl.Callback):
    """Parameters before every step (and at the end), bucket sizes and the secret state (tests only)."""

    def __init__(self, save_to: Any = None) -> None:
        self.params: list[dict[str, Tensor]] = []
        self.buckets: list[int] = []
        self.state: list[Tensor] = []
        self.save_to = save_to

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self.save_to is not None and trainer.global_step == trainer.max_steps:
            trainer.save_checkpoint(self.save_to)  # mid-fit, while the secret state is alive

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.params.append(params_of(pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params.append(params_of(pl_module))
        step = trainer.strategy.private_step
        self.buckets = [b.numel() for b in step.privatizer.buckets]
        self.state = [t.detach().clone() for t in step.noise.state]

    def updates(self) -> np.ndarray:
        """before_t - after_t per step, parameters flattened in optimizer order: shape [steps, d], float64."""
        flat = [torch.cat([p.flatten() for p in ps.values()]).double().cpu().numpy() for ps in self.params]
        return np.stack([a - b for a, b in zip(flat, flat[1:])])


def _banded_matrix(coefs: tuple[float, ...], n: int) -> np.ndarray:
    """Column-normalised lower-triangular Toeplitz matrix, written here from its definition."""
    c = np.zeros((n, n))
    for i in range(n):
        for k, v in enumerate(coefs):
            if i + k < n:
                c[i + k, i] = v
    return c / np.linalg.norm(c, axis=0)


def _blt_matrix(theta: tuple[float, ...], omega: tuple[float, ...], n: int) -> np.ndarray:
    """C with c_0 = 1 and c_k = Σ ω_i θ_i^(k-1), written here from its definition."""
    first = [1.0] + [sum(w * t ** (k - 1) for t, w in zip(theta, omega)) for k in range(1, n)]
    return np.array([[first[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])


def _white(seed: int, stream: int, size: int, steps: int, std: float, rank: int = 0) -> np.ndarray:
    """The documented white noise of one bucket's stream on ``rank``: [steps, size]."""
    rows = []
    for t in range(steps):
        source = GaussianNoise(seed=derive_seed(seed, "correlated", stream), rank=rank)
        source.start_step(t)
        rows.append(source.sample(torch.zeros(size, device=DEVICE), std).double().cpu().numpy())
    return np.stack(rows)


# ---------------------------------------------------------------------------------------------- the release


@pytest.mark.parametrize("engine", ["instantiate", "book_keeping", "auto"])
@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_zero_noise_is_dp_sgd_on_each_step_batch(mechanism: str, engine: str) -> None:
    torch.manual_seed(0)
    module, track = TinyModule(), _Track()
    extra = dict(bands=2) if mechanism == "band_mf" else dict(blt_buffers=1, cyclic_partitions=2)
    dp = strategy(noise_mechanism=mechanism, max_grad_norm=0.3, seed=1, clipping_engine=engine, **extra)
    trainer = make_trainer(dp, max_steps=3, callbacks=[track])
    trainer.fit(module, loader(make_dataset(N), BATCH))
    assert len(module.batches) == 3
    for t, (x, y) in enumerate(module.batches):
        net = mlp()
        net.load_state_dict({k.removeprefix("net."): v for k, v in track.params[t].items()})
        expected = clipped_sum(per_example_grads(net, F.cross_entropy, x, y), 0.3) if len(y) else None
        for name, before in track.params[t].items():
            want = expected[name.removeprefix("net.")] / BATCH if expected is not None else torch.zeros_like(before)
            torch.testing.assert_close(before - track.params[t + 1][name], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_released_noise_is_c_inverse_of_the_regenerated_white_noise(mechanism: str) -> None:
    sigma, c, steps, seed, partitions = 0.9, 0.7, 6, 5, 3
    torch.manual_seed(0)
    track = _Track()
    extra = dict(bands=partitions) if mechanism == "band_mf" else dict(blt_buffers=2, cyclic_partitions=partitions)
    dp = strategy(noise_mechanism=mechanism, noise_multiplier=sigma, max_grad_norm=c, seed=seed, bucket_cap_mb=1e-4,
                  **extra)  # fmt: skip
    trainer = make_trainer(dp, max_steps=steps, callbacks=[track])
    trainer.fit(TinyModule(zero_loss=True), loader(make_dataset(N), BATCH))
    assert len(track.buckets) > 1  # one stream per bucket
    matrix = dp.noise_strategy
    if mechanism == "band_mf":
        assert matrix.coefs == optimize_banded(Workload(), steps, partitions).coefs  # prefix sums for plain SGD
        cmat = _banded_matrix(matrix.coefs, steps)
        # One participation moves C x by at most one clip norm: the amplified accounting's premise.
        assert sensitivity_brute_force(cmat, partitions, 1) == pytest.approx(1.0, abs=1e-12)
        sens = 1.0
    else:
        cmat = _blt_matrix(matrix.theta, matrix.omega, steps)
        sens = sensitivity_brute_force(cmat, partitions)  # every participation the cyclic sampler allows
    assert dp.noise_sensitivity == pytest.approx(sens, rel=1e-9)
    std = sigma * c * sens
    expected = np.concatenate(
        [scipy.linalg.solve_triangular(cmat, _white(seed, i, size, steps, std), lower=True)
         for i, size in enumerate(track.buckets)], axis=1,
    )  # fmt: skip
    np.testing.assert_allclose(track.updates(), expected / BATCH, rtol=1e-4, atol=1e-6)
    # Correlated, not DP-SGD's independent noise: the white noise alone does not explain steps > 0.
    white = np.concatenate([_white(seed, i, s, steps, std) for i, s in enumerate(track.buckets)], axis=1)
    assert not np.allclose(track.updates()[1:], white[1:] / BATCH, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("sigma", [0.0, 0.8])
@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_accumulating_micro_batches_equals_one_batch(mechanism: str, sigma: float) -> None:
    """accumulate_grad_batches=k splits each sampled batch: same samples, same noise, same parameters as k = 1."""
    extra = dict(bands=2) if mechanism == "band_mf" else dict(blt_buffers=1, cyclic_partitions=2)
    finals = []
    for k in (1, 2):
        torch.manual_seed(0)
        module, track = TinyModule(), _Track()
        dp = strategy(noise_mechanism=mechanism, noise_multiplier=sigma, max_grad_norm=0.3, seed=3, **extra)
        make_trainer(dp, max_steps=4, accumulate_grad_batches=k, callbacks=[track]).fit(
            module, loader(make_dataset(N), BATCH)
        )
        assert dp.dp_state.steps == 4
        finals.append(track.params[-1])
    for name, value in finals[0].items():
        torch.testing.assert_close(finals[1][name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_empty_batches_release_noise_only(mechanism: str) -> None:
    """Expected batch 1 (q' = 2 x 1 / 400): about e⁻¹ of the steps sample nobody; each still releases its noise."""
    sigma, c, steps, seed, partitions = 0.9, 0.7, 6, 5, 2
    extra = dict(bands=partitions) if mechanism == "band_mf" else dict(blt_buffers=1, cyclic_partitions=partitions)
    torch.manual_seed(0)
    module, track = TinyModule(zero_loss=True), _Track()
    dp = strategy(noise_mechanism=mechanism, noise_multiplier=sigma, max_grad_norm=c, seed=seed, **extra)
    make_trainer(dp, max_steps=steps, callbacks=[track]).fit(module, loader(make_dataset(400), 1))
    assert dp.dp_state.steps == steps and any(len(y) == 0 for _, y in module.batches)  # seeded: 1 of 6 here
    updates = track.updates()
    assert np.isfinite(updates).all() and (np.abs(updates).sum(1) > 0).all()  # noise on every step, empty or not
    cmat = (
        _banded_matrix(dp.noise_strategy.coefs, steps)
        if mechanism == "band_mf"
        else _blt_matrix(dp.noise_strategy.theta, dp.noise_strategy.omega, steps)
    )
    white = _white(seed, 0, updates.shape[1], steps, sigma * c * dp.noise_sensitivity)
    np.testing.assert_allclose(updates, scipy.linalg.solve_triangular(cmat, white, lower=True), rtol=1e-4, atol=1e-6)


def test_momentum_sgd_gets_the_momentum_workload() -> None:
    dp = strategy(noise_mechanism="band_mf", bands=2, noise_multiplier=1.0)
    module = TinyModule(zero_loss=True, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    make_trainer(dp, max_steps=4).fit(module, loader(make_dataset(N), BATCH))
    assert dp.noise_strategy.coefs == optimize_banded(Workload(momentum=0.9), 4, 2).coefs
    assert dp.noise_strategy.coefs != optimize_banded(Workload(), 4, 2).coefs


def _indexed(n: int) -> TensorDataset:
    """Features whose first column is the example's index."""
    data = make_dataset(n)
    x = data.tensors[0].clone()
    x[:, 0] = torch.arange(n, dtype=x.dtype)
    return TensorDataset(x, data.tensors[1])


def test_a_real_run_never_samples_an_example_twice_within_its_cycle() -> None:
    partitions, steps = 3, 30  # an epoch is 3 x ceil(1 / 0.25) = 12 steps: the run crosses two epoch boundaries
    module = TinyModule(zero_loss=True)
    dp = strategy(noise_mechanism="band_mf", bands=2, cyclic_partitions=partitions, noise_multiplier=0.5)
    make_trainer(dp, max_steps=steps).fit(module, loader(_indexed(N), BATCH))
    assert len(module.batches) == steps
    seen: dict[int, list[int]] = {}
    for t, (x, _) in enumerate(module.batches):
        for i in x[:, 0].long().tolist():
            seen.setdefault(i, []).append(t)
    assert sum(len(v) for v in seen.values()) > steps  # something was sampled
    for i, ts in seen.items():
        assert all(b - a >= partitions for a, b in zip(ts, ts[1:])), (i, ts)
        assert len({t % partitions for t in ts}) == 1, (i, ts)  # always the same partition's turn
    assert dp.sample_rate == partitions * BATCH / N and dp.expected_batch_size == pytest.approx(BATCH)


# ---------------------------------------------------------------------------------------------- accounting


def _fit(dp: dplightning.DPStrategy, steps: int, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(dp, max_steps=steps, **kwargs)
    trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))
    return trainer


@pytest.mark.parametrize(("accountant", "cls"), [("prv", PRVAccountant), ("rdp", RDPAccountant)])
def test_band_mf_epsilon_is_dp_sgd_over_one_step_per_cycle(tmp_path, accountant: str, cls: type) -> None:
    sigma, bands, partitions, steps = 1.1, 2, 4, 9
    dp = strategy(noise_mechanism="band_mf", bands=bands, cyclic_partitions=partitions, noise_multiplier=sigma,
                  accountant=accountant)  # fmt: skip
    trainer = _fit(dp, steps)
    # The equivalent DP-SGD (Choquette-Choo et al. 2023, Thm. 4): rate partitions x B / N, ceil(n / partitions) steps.
    rate, compositions, delta = partitions * BATCH / N, math.ceil(steps / partitions), 1 / (10 * N)
    reference = cls()
    reference.history = [(sigma, rate, compositions)]
    expected = reference.get_epsilon(delta=delta)
    assert dp.get_epsilon() == pytest.approx(expected, rel=1e-12)
    assert dp.steps == steps and dp.ledger.steps == compositions
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    report = privacy_report(load_checkpoint(ckpt))
    assert report["epsilon"] == pytest.approx(expected, rel=1e-12) and report["epsilon_matches"]
    assert report["global_step"] == steps and report["steps"] == compositions
    assert "banded matrix factorization (2 bands" in report["noise_mechanism"] in format_report(report)


def _gaussian_epsilon(sigma: float, delta: float) -> float:
    """ε of the Gaussian mechanism with noise multiplier σ at δ, exactly (Balle & Wang 2018, Thm. 8)."""

    def gap(eps: float) -> float:
        return norm.cdf(0.5 / sigma - eps * sigma) - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma) - delta

    return brentq(gap, 0.0, 100.0)


def test_blt_is_one_gaussian_mechanism_over_the_run_without_amplification() -> None:
    sigma, steps = 2.0, 7
    delta = 1 / (10 * N)
    exact = _gaussian_epsilon(sigma, delta)
    prv = strategy(noise_mechanism="blt", blt_buffers=2, cyclic_partitions=2, noise_multiplier=sigma)
    _fit(prv, steps)
    assert prv.ledger.history == ((sigma, 1.0, 1),)
    assert exact <= prv.get_epsilon() <= exact * 1.01  # PRV reports an upper bound
    line = prv.accounting.report("auto")  # the run's last log line names the rate the ledger used
    assert f"q = {prv.accounting.sample_rate:.4g} sampled, accounted at q = 1" in line and "not amplified" in line
    rdp = strategy(noise_mechanism="blt", blt_buffers=2, cyclic_partitions=2, noise_multiplier=sigma, accountant="rdp")
    _fit(rdp, steps)
    reference = RDPAccountant()
    reference.history = [(sigma, 1.0, 1)]
    assert rdp.get_epsilon() == pytest.approx(reference.get_epsilon(delta=delta), rel=1e-12)
    assert rdp.get_epsilon() >= exact


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_target_epsilon_calibrates_sigma_for_the_equivalent_mechanism(mechanism: str) -> None:
    target, steps, partitions = 3.0, 8, 2
    extra = dict(bands=2) if mechanism == "band_mf" else dict(blt_buffers=1, cyclic_partitions=partitions)
    dp = strategy(noise_mechanism=mechanism, target_epsilon=target, noise_multiplier=None, **extra)
    _fit(dp, steps)
    sigma, delta = dp.noise_multiplier, 1 / (10 * N)
    reference = PRVAccountant()
    if mechanism == "band_mf":
        reference.history = [(sigma, partitions * BATCH / N, math.ceil(steps / partitions))]
        eps = reference.get_epsilon(delta=delta)
    else:
        eps = _gaussian_epsilon(sigma, delta)
    assert 0.97 * target <= eps <= target * 1.0001
    assert dp.get_epsilon() == pytest.approx(target, rel=0.03) and dp.get_epsilon() <= target


def _google_event(mechanism: str, sigma: float, steps: int, partitions: int) -> Any:
    """The dp_accounting event JAX-Privacy builds: amplified BandMF, or one Gaussian mechanism for BLT."""
    import dp_accounting

    if mechanism == "blt":
        return dp_accounting.GaussianDpEvent(sigma)
    inner = dp_accounting.PoissonSampledDpEvent(partitions * BATCH / N, dp_accounting.GaussianDpEvent(sigma))
    return dp_accounting.SelfComposedDpEvent(inner, math.ceil(steps / partitions))


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_epsilon_agrees_with_google_dp_accounting(mechanism: str) -> None:
    """An accountant written independently of Opacus, given the events JAX-Privacy builds for these mechanisms.

    PRV must not report less than dp_accounting's PLD (both are tight; PRV's is an upper bound,
    so a little more), RDP must agree with its RDP, and a calibrated σ must meet the target there.
    """
    dp_accounting = pytest.importorskip("dp_accounting", reason="the dev extra installs dp-accounting")
    sigma, steps, partitions, delta, target = 1.1, 9, 4, 1 / (10 * N), 2.0
    extra = dict(bands=2) if mechanism == "band_mf" else dict(blt_buffers=2)
    event = _google_event(mechanism, sigma, steps, partitions)
    references = [("prv", dp_accounting.pld.PLDAccountant()), ("rdp", dp_accounting.rdp.RdpAccountant())]
    for accountant, reference in references:
        dp = strategy(noise_mechanism=mechanism, cyclic_partitions=partitions, noise_multiplier=sigma,
                      accountant=accountant, **extra)  # fmt: skip
        _fit(dp, steps)
        expected = reference.compose(event).get_epsilon(delta)
        if accountant == "prv":
            assert expected <= dp.get_epsilon() <= expected * 1.01
        else:
            assert dp.get_epsilon() == pytest.approx(expected, rel=1e-3)
    calibrated = strategy(noise_mechanism=mechanism, cyclic_partitions=partitions, target_epsilon=target,
                          noise_multiplier=None, **extra)  # fmt: skip
    _fit(calibrated, steps)
    event = _google_event(mechanism, calibrated.dp_state.noise_multiplier, steps, partitions)
    assert 0.97 * target <= dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta) <= target


# ---------------------------------------------------------------------------------------------- secret state


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in _tensors(k) + _tensors(v)]
    if isinstance(obj, (list, tuple, set)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _scalars(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _scalars(k) + _scalars(v)]
    if isinstance(obj, (list, tuple, set)):
        return [s for v in obj for s in _scalars(v)]
    return [obj]


@pytest.mark.parametrize("mechanism", ["band_mf", "blt"])
def test_the_secret_noise_state_is_never_in_the_checkpoint_and_resume_is_refused(tmp_path, mechanism: str) -> None:
    seed = 987654321
    ckpt = tmp_path / "run.ckpt"
    track = _Track(save_to=ckpt)
    extra = dict(bands=3) if mechanism == "band_mf" else dict(blt_buffers=2, cyclic_partitions=3)
    trainer = make_trainer(strategy(noise_mechanism=mechanism, noise_multiplier=1.0, seed=seed, **extra), max_steps=4,
                           callbacks=[track])  # fmt: skip
    trainer.fit(TinyModule(zero_loss=True, optimizer=lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.5)),
                loader(make_dataset(N), BATCH))  # fmt: skip
    # The state memory-plan and the docs state: 2 fp32 buffers of the noised size (bands - 1 = blt_buffers = 2).
    noised = sum(p.numel() for p in track.params[0].values())
    assert [t.dtype for t in track.state] == [torch.float32] * len(track.state)
    assert sum(t.numel() for t in track.state) == 2 * noised
    secret = torch.cat([t.flatten().cpu() for t in track.state])
    secret = secret[secret != 0]
    assert secret.numel() > 0
    loaded = torch.load(ckpt, map_location="cpu", weights_only=False)
    tensors = [t.detach().float().flatten().cpu() for t in _tensors(loaded) if t.is_floating_point()]
    assert tensors  # weights and momentum buffers are there ...
    for t in tensors:  # ... but not one value of the secret buffers, in any layout
        assert not torch.isin(t, secret).any()
    assert seed not in [s for s in _scalars(loaded) if isinstance(s, int)] and str(seed) not in repr(loaded)
    record = loaded[CHECKPOINT_KEY]["noise_mechanism"]
    assert record["name"] == mechanism and record["planned_steps"] == record["released_steps"] == 4
    with pytest.raises(ValueError, match="Resuming is not supported"):
        make_trainer(strategy(noise_mechanism=mechanism, noise_multiplier=1.0, **extra), max_steps=6).fit(
            TinyModule(), loader(make_dataset(N), BATCH), ckpt_path=ckpt
        )
    with pytest.raises(ValueError, match="cannot be resumed") as refused:  # nor continued as DP-SGD
        make_trainer(strategy(noise_multiplier=1.0), max_steps=6).fit(
            TinyModule(), loader(make_dataset(N), BATCH), ckpt_path=ckpt
        )
    # Finding 40.8: the advice to fine-tune in a new run must compose the runs.
    assert "does not include the first run's" in str(refused.value) and "init_from=" in str(refused.value)


def test_a_ledger_short_of_its_cycles_is_refused(tmp_path) -> None:
    trainer = _fit(strategy(noise_mechanism="band_mf", bands=2, noise_multiplier=1.0), 5)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    checkpoint = load_checkpoint(tmp_path / "run.ckpt")
    state = checkpoint[CHECKPOINT_KEY]
    check_ledger(state, 5)  # ceil(5 / 2) = 3 compositions
    sigma, q, _ = state["ledger"]["history"][0]
    state["ledger"]["history"] = [(sigma, q, 2)]
    with pytest.raises(InconsistentLedger, match="charges 3"):
        privacy_of(checkpoint)


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(noise_mechanism="band_mf"), "needs bands="),
        (dict(noise_mechanism="band_mf", bands=4, cyclic_partitions=2), "bands=4 > cyclic_partitions=2"),
        (dict(noise_mechanism="blt", blt_buffers=2), "needs blt_buffers= .* and cyclic_partitions="),
        (dict(noise_mechanism="gaussian", bands=2), "do not apply"),
        (dict(noise_mechanism="blt", blt_buffers=2, cyclic_partitions=2, bands=2), "do not apply"),
        (dict(noise_mechanism="band_mf", bands=0), "bands must be an int >= 1"),
        (dict(noise_mechanism="band_mf", bands=2, poisson_sampling=False), "needs poisson_sampling=True"),
        (dict(noise_mechanism="band_mf", bands=2, privacy_journal="j"), "privacy_journal does not apply"),
        (dict(noise_mechanism="dense"), "Unknown noise_mechanism"),
    ],
)
def test_configurations_outside_the_accounting_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        strategy(noise_multiplier=1.0, **kwargs)


@pytest.mark.parametrize(
    ("trainer_kwargs", "match"),
    [
        (dict(max_steps=-1, max_epochs=-1), "finite training length"),
        (dict(max_steps=8, limit_train_batches=3), "not a multiple of cyclic_partitions=2"),
        (dict(max_steps=8, callbacks=[PrivacyBudget(target_epsilon=5.0)]), "PrivacyBudget is not supported"),
    ],
)
def test_runs_outside_the_accounting_are_refused(trainer_kwargs: dict, match: str) -> None:
    dp = strategy(noise_mechanism="band_mf", bands=2, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=match):
        make_trainer(dp, **trainer_kwargs).fit(TinyModule(), loader(make_dataset(N), BATCH))


def test_partitions_too_many_for_the_batch_are_refused() -> None:
    dp = strategy(noise_mechanism="band_mf", bands=16, noise_multiplier=1.0)  # 16 x 4 / 48 > 1
    with pytest.raises(ValueError, match="at most N / expected batch = 12"):
        make_trainer(dp, max_steps=4).fit(TinyModule(), loader(make_dataset(N), BATCH))


def test_step_releases_and_a_second_fit_are_refused() -> None:
    dp = strategy(noise_mechanism="band_mf", bands=2, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="not supported with noise_mechanism='band_mf'"):
        dp.register_step_release("count", 5.0)
    trainer = _fit(dp, 2)
    trainer.fit_loop.epoch_loop.max_steps = 4
    with pytest.raises(ValueError, match="cannot continue in a second fit"):
        trainer.fit(TinyModule(), loader(make_dataset(N), BATCH))


class _Unfreezes(TinyModule):
    """Freezes its last layer for the first step, then trains it: the privatized parameters change."""

    def __init__(self) -> None:
        super().__init__(net=nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
        self.net[2].requires_grad_(False)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.net[2].requires_grad_(True)


def test_changing_trainable_parameters_mid_run_is_refused() -> None:
    dp = strategy(noise_mechanism="band_mf", bands=2, noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="trainable parameters changed at step 1"):
        make_trainer(dp, max_steps=3).fit(_Unfreezes(), loader(make_dataset(N), BATCH))


class _KeepsReleases(ProjectedSGD):
    """An optimizer with a DP plan (projected slots, one clip group per matrix) that keeps every release."""

    def dp_release(self, release: DPRelease) -> None:
        super().dp_release(release)
        order = [p for g in release.groups for p in g.params]  # the bucket layout: group by group
        flat = torch.cat([release.slots[p].flatten() for p in order]).double().cpu().numpy()
        self.kept = [*getattr(self, "kept", []), (flat, release.noise_std, len(release.groups))]


def test_an_optimizer_plan_receives_correlated_noise_on_its_slots_and_its_per_step_std() -> None:
    sigma, c, steps, seed = 0.8, 0.5, 5, 3
    module = TinyModule(zero_loss=True, optimizer=lambda params: _KeepsReleases(params, lr=0.1, rank=2))
    dp = strategy(noise_mechanism="band_mf", bands=2, noise_multiplier=sigma, max_grad_norm=c, seed=seed)
    make_trainer(dp, max_steps=steps).fit(module, loader(make_dataset(N), BATCH))
    kept = module.trainer.optimizers[0].kept
    assert len(kept) == steps and kept[0][2] > 1  # several clip groups of the plan, joint sensitivity c
    released = np.stack([flat for flat, _, _ in kept])
    cmat = _banded_matrix(dp.noise_strategy.coefs, steps)
    white = _white(seed, 0, released.shape[1], steps, sigma * c)
    np.testing.assert_allclose(released, scipy.linalg.solve_triangular(cmat, white, lower=True) / BATCH,
                               rtol=1e-4, atol=1e-6)  # fmt: skip
    # The std the plan is told is that of z_t: σ Δ times the norm of row t of C⁻¹ (not σ Δ).
    rows = np.linalg.norm(np.linalg.inv(cmat), axis=1)
    np.testing.assert_allclose([s for _, s, _ in kept], sigma * c * rows / BATCH, rtol=1e-9)
    assert not np.allclose(rows, 1.0)
