"""The invariants of design/lightning_dp.md for DPDDPStrategy on 2 spawned CPU/gloo ranks.

Each rank dumps its final state (tests.helpers.DumpRankState); the test process
compares ranks with each other and with single-process references.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import PRVAccountant
from torch import nn

import dplightning
from dplightning.privacy.noise import GaussianNoise
from tests.helpers import ManualModule, TinyModule, loader, make_dataset, make_trainer, mlp, params_of, run_ddp
from tests.reference import clipped_sum, per_example_grads

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

N, BATCH, WORLD = 64, 8, 2  # per-process batch 8: q = 8 * 2 / 64 = 0.25, expected global batch B = 16
B = BATCH * WORLD


@pytest.mark.parametrize("engine", ["instantiate"])  # the union test below runs the other engines on 2 ranks
def test_ranks_stay_bitwise_identical_and_share_one_epsilon(tmp_path, engine: str) -> None:
    torch.manual_seed(0)
    ranks = run_ddp(TinyModule(lr=0.3), loader(make_dataset(N), BATCH), str(tmp_path), clipping_engine=engine,
                    noise_multiplier=1.0, max_steps=6, accumulate_grad_batches=2)  # fmt: skip
    first, second = ranks
    for name in first["params"]:
        assert torch.equal(first["params"][name], second["params"][name]), name
    assert first["history"] == second["history"] == ((1.0, B / N, 6),)
    assert first["epsilon"] == second["epsilon"]
    assert first["sample_rate"] == B / N
    reference = PRVAccountant()
    reference.history = [(1.0, B / N, 6)]
    assert first["epsilon"] == pytest.approx(reference.get_epsilon(delta=1 / (10 * N)), rel=1e-12)
    # No redundant reduction of the raw gradient: exactly one all-reduce per bucket per step.
    assert first["all_reduce_calls"] == second["all_reduce_calls"] == 6 * first["buckets"]


@pytest.mark.parametrize(
    ("clipping", "engine", "manual", "precision", "tolerance", "replay"),
    [
        ("flat", "auto", False, "32-true", 1e-5, False),
        ("flat", "instantiate", False, "32-true", 1e-5, False),
        ("per_layer", "auto", False, "32-true", 1e-5, False),
        ("per_matrix", "book_keeping", False, "32-true", 1e-5, False),
        ("flat", "auto", True, "bf16-mixed", 5e-2, False),
        ("flat", "book_keeping", False, "32-true", 1e-5, True),
        ("per_matrix", "instantiate", False, "bf16-mixed", 5e-2, True),
    ],
    ids=[
        "flat",
        "flat-instantiate",
        "per_layer",
        "per_matrix-book_keeping",
        "manual-bf16",
        "flat-book_keeping-replay",
        "per_matrix-instantiate-bf16-replay",
    ],
)
def test_zero_noise_step_equals_one_process_on_the_union(
    tmp_path, clipping: str, engine: str, manual: bool, precision: str, tolerance: float, replay: bool
) -> None:
    torch.manual_seed(0)
    module = ManualModule() if manual else TinyModule()
    before = params_of(module)
    # With clip_replay the (only) step is replayed: its verification, which holds, is off.
    ranks = run_ddp(module, loader(make_dataset(N), BATCH), str(tmp_path), max_grad_norm=0.3, clipping=clipping,
                    clipping_engine=engine, seed=4, bucket_cap_mb=1e-4,  # several buckets
                    precision=precision, clip_replay=replay,
                    verify_gradients="never" if replay else "first_steps")  # fmt: skip
    x = torch.cat([b[0] for r in ranks for b in r["batches"]])
    y = torch.cat([b[1] for r in ranks for b in r["batches"]])
    assert all(r["buckets"] > 1 for r in ranks)
    net = mlp()
    net.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    groups = {
        "flat": None,
        "per_layer": [["0.weight", "0.bias"], ["2.weight", "2.bias"]],
        "per_matrix": [["0.weight"], ["2.weight"], ["0.bias", "2.bias"]],
    }[clipping]
    expected = clipped_sum(per_example_grads(net, F.cross_entropy, x, y), 0.3, groups)
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(
            before[name] - value, expected[name.removeprefix("net.")] / B, rtol=tolerance, atol=tolerance / 100
        )


@pytest.mark.parametrize("placement", ["rank0", "split"])
def test_noise_is_added_exactly_once_globally(tmp_path, placement: str) -> None:
    sigma, c = 1.3, 0.7
    torch.manual_seed(0)
    module = TinyModule(net=nn.Sequential(nn.Linear(6, 400), nn.Linear(400, 3)), zero_loss=True)
    before = params_of(module)
    ranks = run_ddp(module, loader(make_dataset(N), BATCH), str(tmp_path), noise_multiplier=sigma, max_grad_norm=c,
                    seed=9, noise_placement=placement)  # fmt: skip
    update = torch.cat([(before[n] - v).flatten() for n, v in ranks[0]["params"].items()])
    n = update.numel()
    # Statistical: std σC/B, neither W times the variance (noise on every rank) nor 1/W of it.
    assert abs(update.std().item() / (sigma * c / B) - 1) < 5 / math.sqrt(2 * n)
    # Exact: the regenerated stream(s) of step 0.
    streams = [0] if placement == "rank0" else list(range(WORLD))
    share = sigma * c if placement == "rank0" else sigma * c / math.sqrt(WORLD)
    expected = torch.zeros(n)
    for rank in streams:
        noise = GaussianNoise(seed=9, rank=rank)
        noise.start_step(0)
        expected += noise.sample(torch.zeros(n), share)
    torch.testing.assert_close(update, expected / B)


def test_tiny_rate_with_empty_local_batches_neither_hangs_nor_desyncs(tmp_path) -> None:
    torch.manual_seed(0)
    ranks = run_ddp(TinyModule(), loader(make_dataset(400), batch_size=1), str(tmp_path),
                    noise_multiplier=1.0, max_steps=25, accumulate_grad_batches=2)  # q = 2/400  # fmt: skip
    assert [r["steps"] for r in ranks] == [25, 25]
    for name in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name])
        assert torch.isfinite(ranks[0]["params"][name]).all()


def test_resume_on_two_ranks_continues_epsilon_exactly(tmp_path) -> None:
    ckpt = str(tmp_path / "dp.ckpt")
    torch.manual_seed(0)
    run_ddp(
        TinyModule(), loader(make_dataset(N), BATCH), str(tmp_path), noise_multiplier=0.8, max_steps=5, save_to=ckpt
    )
    ranks = run_ddp(TinyModule(), loader(make_dataset(N), BATCH), str(tmp_path), noise_multiplier=0.8, max_steps=9,
                    ckpt_path=ckpt)  # fmt: skip
    reference = PRVAccountant()
    reference.history = [(0.8, B / N, 9)]
    expected = reference.get_epsilon(delta=1 / (10 * N))
    for r in ranks:
        assert r["steps"] == 9 and r["history"] == ((0.8, B / N, 9),)
        assert r["epsilon"] == pytest.approx(expected, rel=1e-12)


class _SyncedLog(TinyModule):
    """Logs with ``sync_dist=True`` from ``training_step``: a collective every rank must reach."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.record(x, y)
        loss = F.cross_entropy(self(x), y, reduction="sum") / max(len(y), 1)
        self.log("nonprivate/loss", loss, sync_dist=True, batch_size=len(y))
        return loss


def test_collectives_in_training_step_do_not_hang_on_an_empty_local_batch(tmp_path) -> None:
    torch.manual_seed(0)
    ranks = run_ddp(_SyncedLog(), loader(make_dataset(400), batch_size=1), str(tmp_path), noise_multiplier=1.0,
                    max_steps=8, timeout=timedelta(seconds=30))  # q = 2/400: most local batches are empty  # fmt: skip
    assert [r["steps"] for r in ranks] == [8, 8]
    assert [len(r["batches"]) for r in ranks] == [8, 8]  # training_step ran on every rank, empty batches included
    assert any(len(x) == 0 for r in ranks for x, _ in r["batches"])


def test_resuming_target_epsilon_at_another_world_size_is_refused(tmp_path) -> None:
    first = make_trainer(dplightning.DPStrategy(target_epsilon=2.0), max_steps=3)
    first.fit(TinyModule(), loader(make_dataset(N), BATCH))
    first.save_checkpoint(tmp_path / "one.ckpt")
    with pytest.raises(Exception, match="overspent"):  # q = 16/64 on one process, 2 x 16/64 on two
        run_ddp(TinyModule(), loader(make_dataset(N), BATCH), str(tmp_path), target_epsilon=2.0, max_steps=6,
                ckpt_path=tmp_path / "one.ckpt", noise_multiplier=None, timeout=timedelta(seconds=30))  # fmt: skip


class _ShardPerRank(TinyModule):
    """Gives each rank a data set of its own length (pre-sharded data)."""

    def train_dataloader(self):
        return loader(make_dataset(N + 8 * self.trainer.global_rank), BATCH)


def test_ranks_with_different_data_set_lengths_are_refused(tmp_path) -> None:
    with pytest.raises(Exception, match="disagree on.*num_samples"):
        run_ddp(_ShardPerRank(), None, str(tmp_path), noise_multiplier=1.0, max_steps=2,
                use_distributed_sampler=False, timeout=timedelta(seconds=30))  # fmt: skip


class _PenaltyOnRankOne(TinyModule):
    """Rank 1 adds a weight penalty in training_step (it bypasses the hooks): only its verification fails."""

    def training_step(self, batch, batch_idx: int):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == 1:
            loss = loss + 0.1 * self.net[0].weight.square().sum()
        return loss


def _assert_every_rank_stops(module: TinyModule, match: str, folder: str, max_steps: int) -> None:
    """The fit raises ``match`` well before the process group's 150 s timeout: no rank was left waiting."""
    start = time.monotonic()
    with pytest.raises(Exception, match=match):
        run_ddp(module, loader(make_dataset(N), BATCH), folder, noise_multiplier=1.0, max_steps=max_steps,
                timeout=timedelta(seconds=150))  # fmt: skip
    assert time.monotonic() - start < 100


def test_a_check_that_one_rank_refuses_stops_every_rank(tmp_path) -> None:
    """The ranks decide a check's outcome together: no rank is left waiting in the release (finding 51.A5a)."""
    match = "Autograd's gradient differs|Another process refused this step"
    _assert_every_rank_stops(_PenaltyOnRankOne(), match, str(tmp_path), max_steps=2)


class _EpochEndOnRankOne(TinyModule):
    """Rank 1 alone ends epoch 0 after its first batch (a user's hook that decides on the local data)."""

    def on_train_batch_start(self, batch, batch_idx: int):  # type: ignore[no-untyped-def]
        return -1 if self.trainer.global_rank == 1 and self.current_epoch == 0 and batch_idx == 1 else None


class _EpochEndOnEveryRank(TinyModule):
    def on_train_batch_start(self, batch, batch_idx: int):  # type: ignore[no-untyped-def]
        return -1 if self.current_epoch == 0 and batch_idx == 1 else None


def test_an_epoch_end_on_one_rank_stops_every_rank(tmp_path) -> None:
    """No rank is left waiting in the release for one that ended its epoch alone (finding 51.A5b)."""
    _assert_every_rank_stops(_EpochEndOnRankOne(), "returned -1 .* on 1 of 2 ranks", str(tmp_path), max_steps=6)


class _StopOnRankOne(TinyModule):
    """Rank 1 alone sets trainer.should_stop after its second batch (an early stop decided on local data)."""

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:  # type: ignore[no-untyped-def]
        if self.trainer.global_rank == 1 and batch_idx == 1:
            self.trainer.should_stop = True


def test_a_fit_stopped_on_one_rank_stops_every_rank(tmp_path) -> None:
    _assert_every_rank_stops(_StopOnRankOne(), "should_stop was set .* on 1 of 2 ranks", str(tmp_path), max_steps=6)


def test_an_epoch_end_on_every_rank_trains_on(tmp_path) -> None:
    ranks = run_ddp(_EpochEndOnEveryRank(), loader(make_dataset(N), BATCH), str(tmp_path), noise_multiplier=1.0,
                    max_steps=6, timeout=timedelta(seconds=60))  # fmt: skip
    assert [r["steps"] for r in ranks] == [6, 6]
