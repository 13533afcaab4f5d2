"""Crash safety: SIGKILL at random points of a budget-limited run, then resume from the last checkpoint.

The rule (docs/dp_sgd_core.md, "Crash safety"): the ledger counts a step when its noisy
gradient is released, before the optimizer applies it, and checkpoints are written
atomically; so every checkpoint on disk loads, its ledger covers every update in its
weights, and a resumed budget-limited run ends at the same total steps and exact ε.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import warnings

import pytest
import torch
from opacus.accountants import GaussianAccountant

from dplightning.callbacks import PrivacyBudget
from dplightning.strategies._dp import CHECKPOINT_KEY
from dplightning.strategies.checkpoint import atomic_save
from tests.helpers import TinyModule, loader, make_dataset, make_trainer
from tests.strategies import _crash_child as child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
SEEDS = range(5)


def _kill_point(seed: int) -> tuple[int, str]:
    rng = random.Random(seed)
    phase = child.PHASES[seed % len(child.PHASES)]  # every phase once over the seeds, at a random step
    return rng.randint(1, child.TOTAL), phase


def _run_killed(folder: str, step: int, phase: str, seed: int, journal: str | None = None) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: train until it kills itself; never return into pytest
        code = 3
        try:
            child.main(folder, step, phase, seed, journal)
        except BaseException:  # noqa: B036
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _journal(folder: str) -> list[tuple[str, int, int]]:
    path = os.path.join(folder, "journal.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(tag, int(g), int(s)) for tag, g, s in (line.split() for line in f if line.strip())]


@pytest.mark.crash
@pytest.mark.parametrize("seed", SEEDS)
def test_sigkill_anywhere_then_resume_keeps_the_epsilon_rule_and_the_total_steps(tmp_path, seed: int) -> None:
    step, phase = _kill_point(seed)
    folder = str(tmp_path)
    status = _run_killed(folder, step, phase, seed)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child ended with status {status}"

    # Every update was accounted before it could be observed: counted at the release, then applied.
    for tag, global_step, ledger_steps in _journal(folder):
        assert ledger_steps == global_step + (tag == "pre")
    last = os.path.join(folder, "last.ckpt")
    ckpt_path = None
    if os.path.exists(last):
        saved = torch.load(last, weights_only=False)  # loads: never a truncated file under the final name
        ledger_steps = sum(t for _, _, t in saved[CHECKPOINT_KEY]["ledger"]["history"])
        assert ledger_steps == saved["global_step"]  # its weights hold exactly the accounted updates
        assert saved["global_step"] == step - 1  # the update of the killed step never reached a checkpoint
        ckpt_path = last
    else:
        assert step == 1  # killed before the first checkpoint was complete

    target = child.budget()
    module = TinyModule()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a mid-epoch resume of a non-stateful loader warns
        resumed = make_trainer(child.strategy(seed + 100), callbacks=[PrivacyBudget(target)], max_steps=50)
        resumed.fit(module, loader(make_dataset(child.N), child.BATCH), ckpt_path=ckpt_path)
    assert resumed.strategy.steps == resumed.global_step == child.TOTAL
    assert resumed.strategy.ledger.history == ((child.SIGMA, child.Q, child.TOTAL),)
    reference = GaussianAccountant()
    reference.history = [(child.SIGMA, child.Q, child.TOTAL)]
    eps = resumed.strategy.get_epsilon()
    assert eps == pytest.approx(reference.get_epsilon(delta=1 / (10 * child.N)), rel=1e-12)
    assert eps <= target


@pytest.mark.crash
@pytest.mark.parametrize(("phase", "charged"), [("after_update", 1), ("before_update", 1), ("training_step", 0)])
def test_the_journal_charges_a_step_released_after_the_last_checkpoint(tmp_path, phase: str, charged: int) -> None:
    journal, step = str(tmp_path / "journal"), 3
    status = _run_killed(str(tmp_path), step, phase, seed=7, journal=journal)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    target = child.budget()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = make_trainer(child.strategy(8, journal), callbacks=[PrivacyBudget(target)], max_steps=50)
        resumed.fit(TinyModule(), loader(make_dataset(child.N), child.BATCH), ckpt_path=str(tmp_path / "last.ckpt"))
    assert any("released after the checkpoint" in str(w.message) for w in caught) == bool(charged)
    # Step 3's noisy gradient was released (and, after_update, applied) by the killed run: it is charged,
    # so the budget stops the resumed run one update earlier, at the same ε.
    assert resumed.strategy.steps == child.TOTAL and resumed.global_step == child.TOTAL - charged
    reference = GaussianAccountant()
    reference.history = [(child.SIGMA, child.Q, child.TOTAL)]
    assert resumed.strategy.get_epsilon() == pytest.approx(reference.get_epsilon(delta=1 / (10 * child.N)))


def test_atomic_save_leaves_the_old_file_when_the_write_fails(tmp_path) -> None:
    path = tmp_path / "last.ckpt"
    atomic_save({"v": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("fails halfway through the write")

    with pytest.raises(RuntimeError, match="halfway"):
        atomic_save({"v": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=False) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left behind
