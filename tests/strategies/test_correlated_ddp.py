"""Correlated noise on 2 spawned CPU/gloo ranks (dp_ddp): added once, equal to one process, every engine exact.

Each rank dumps its final state (tests.helpers.DumpRankState). The reference regenerates the
documented white-noise streams and solves C z = w densely with C rebuilt from its public
coefficients (as in tests/strategies/test_correlated.py).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from torch import nn

import dplightning
from dplightning.privacy.matrix_mechanism import Workload, optimize_banded
from tests.helpers import DumpRankState, TinyModule, loader, make_dataset, make_trainer, mlp, params_of, run_ddp
from tests.reference import clipped_sum, per_example_grads
from tests.strategies.test_correlated import _banded_matrix, _white

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

N, BATCH, WORLD, BANDS, STEPS = 64, 4, 2, 2, 3  # per-process batch 4: expected global batch B = 8
B = BATCH * WORLD


def _module() -> TinyModule:
    torch.manual_seed(0)
    return TinyModule(net=nn.Sequential(nn.Linear(6, 400), nn.Linear(400, 3)), zero_loss=True)


def _fit(folder: Path, world: int, **dp: Any) -> list[dict[str, Any]]:
    """Fit on ``world`` processes with the same global expected batch; every rank's final record."""
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = dplightning.DPStrategy(**dp) if world == 1 else dplightning.DPDDPStrategy(start_method="spawn", **dp)
    trainer = make_trainer(strategy, max_steps=STEPS, devices=world, accelerator="cpu",
                           callbacks=[DumpRankState(str(folder))])  # fmt: skip
    trainer.fit(_module(), loader(make_dataset(N), B // world))
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("placement", ["rank0", "split"])
def test_correlated_noise_is_added_once_and_equals_one_process(tmp_path: Path, placement: str) -> None:
    sigma, c, seed = 1.3, 0.7, 9
    dp = dict(noise_mechanism="band_mf", bands=BANDS, noise_multiplier=sigma, max_grad_norm=c, seed=seed)
    ranks = _fit(tmp_path / "two", WORLD, noise_placement=placement, **dp)
    for name in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
    # One composition per cycle of BANDS steps at the partition's rate BANDS x B / N, on every rank.
    assert ranks[0]["history"] == ranks[1]["history"] == ((sigma, BANDS * B / N, math.ceil(STEPS / BANDS)),)
    assert ranks[0]["buckets"] == 1
    before = params_of(_module())
    update = torch.cat([(before[n] - v).flatten() for n, v in ranks[0]["params"].items()]).double().numpy()
    size = update.size
    # Exact: Σ_t z_t / B with z = C⁻¹ w, w the sum of the noising ranks' regenerated streams.
    cmat = _banded_matrix(optimize_banded(Workload(), STEPS, BANDS).coefs, STEPS)
    noising = [0] if placement == "rank0" else list(range(WORLD))
    share = sigma * c / (1 if placement == "rank0" else math.sqrt(WORLD))
    white = sum(_white(seed, 0, size, STEPS, share, rank=r) for r in noising)
    z = scipy.linalg.solve_triangular(cmat, white, lower=True)
    np.testing.assert_allclose(update, z.sum(0) / B, rtol=1e-4, atol=1e-6)
    # Statistical: Var(Σ_t z_t) = (σC)² ‖1ᵀC⁻¹‖², neither W times it (noise on every rank) nor 1/W of it.
    expected_std = sigma * c * np.linalg.norm(np.ones(STEPS) @ np.linalg.inv(cmat)) / B
    assert abs(update.std() / expected_std - 1) < 5 / math.sqrt(2 * size)
    if placement == "rank0":  # rank 0 draws what one process draws: the same release
        (one,) = _fit(tmp_path / "one", 1, **dp)
        for name, value in one["params"].items():
            torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-5, atol=1e-7)
        assert one["history"] == ranks[0]["history"]


@pytest.mark.parametrize(
    ("mechanism", "engine"),
    [("band_mf", "instantiate"), ("blt", "book_keeping"), ("band_mf", "auto")],
    ids=["band_mf-instantiate", "blt-book_keeping", "band_mf-auto"],
)
def test_zero_noise_step_is_the_clipped_mean_of_the_union_with_every_engine(
    tmp_path: Path, mechanism: str, engine: str
) -> None:
    """σ = 0: the step the ranks take together is the clipped sum over both ranks' samples / B (torch.func)."""
    torch.manual_seed(0)
    module = TinyModule()
    before = params_of(module)
    extra = dict(bands=BANDS) if mechanism == "band_mf" else dict(blt_buffers=1, cyclic_partitions=BANDS)
    ranks = run_ddp(module, loader(make_dataset(N), BATCH), str(tmp_path), noise_mechanism=mechanism,
                    clipping_engine=engine, max_grad_norm=0.3, seed=4, max_steps=1, **extra)  # fmt: skip
    for name in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
    x = torch.cat([b[0] for r in ranks for b in r["batches"]])
    y = torch.cat([b[1] for r in ranks for b in r["batches"]])
    assert 0 < len(y) and not set(map(tuple, ranks[0]["batches"][0][0].tolist())) & set(
        map(tuple, ranks[1]["batches"][0][0].tolist())
    )  # disjoint shares of one partition's sample
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    expected = clipped_sum(per_example_grads(net, F.cross_entropy, x, y), 0.3)
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(before[name] - value, expected[name.removeprefix("net.")] / B, rtol=1e-5, atol=1e-7)
