"""DP-aware AdaLN-Zero against DP-vanilla on ETTh1 imputation, through the comparison protocol (issue 24).

Every arm trains the same ``TimeSeriesDiT`` (the spec's two-path layout, v-prediction on windows
centred on their context mean: the setting that learns, ``adaln_learning_check.py``) for the same
steps, expected batch, C and σ, hence the same ε. The aware arms bound the condition (``c_max``) and
the modulation (γ/β/α_max) at values calibrated once on the *validation months* by an unbounded
twin (``dplightning.methods.adaln_bounds``), then frozen in ``configs/timeseries/``. Two calibrations
(``--calibration``): ``heldout`` (pre-registered first) trains the twin without DP
(``bounds_etth1_imputation.yaml``); ``matched`` (pre-registered second, after ``heldout``'s bounds
never bound under DP) trains it with DP-SGD at the condition's σ
(``bounds_etth1_imputation_dp_sigma{σ}.yaml``), so the bounds meet the values a private model
reaches. A pre-registered, data-independent fault process (unit errors ×10 and whole-channel missing
blocks over one channel of the window, targets clean) hits a share p of the *training* windows;
every final run is scored on the clean test windows (the metric) and on the same windows with every
one faulted (``crps_faulted``).

Experiments (paired seeds 0–4; lr tuned per arm on validation windows in ``main`` and
``nonprivate``, the other experiments reuse ``main``'s selection and say so):

* ``main``: σ = 0.5, p = 3 %: DP-vanilla vs DP-aware (soft). The pre-registered test.
* ``null``: σ = 0.5, p = 0 (the expected null: no conditioning outliers).
* ``nonprivate``: no DP, p = 3 %: vanilla vs aware (criterion iv).
* ``sigma0.1``, ``sigma0``: p = 3 % at σ = 0.1 (clipping-dominated) and σ = 0 (clipping only, ε = ∞).
* ``ablation``: σ = 0.5, p = 3 %: hard bounds, c-only, modulation-only (DP-vanilla borrowed from ``main``).
* ``p1``: σ = 0.5, p = 1 %.
* ``ablation0.1``, ``null0.1``, ``p1_0.1``: the ablations, the null and p = 1 % at σ = 0.1 (added before their
  runs: under the lr-matched calibration the bounds are vacuous at σ = 0.5 and act at σ = 0.1).

The criteria (i)–(iv) and the vacuity rule are written in ``CLAIMS`` and in docs/dp_aware_adaln.md
before the final runs. The premise diagnostics (per-example gradient norms of the conditioning path
against the rest, on the faulted and on 256 clean *training* windows, after training) are computed
from the private data and are NOT differentially private; so are the bind fractions.

    OMP_NUM_THREADS=1 python benchmarks/adaln_protocol.py --workers 2
    OMP_NUM_THREADS=1 python benchmarks/adaln_protocol.py --workers 2 --calibration matched
    OMP_NUM_THREADS=1 python benchmarks/adaln_protocol.py --smoke            # the code path in a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import json
import math
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import yaml
from _harness import quiet_trainer
from _outputs import default_figures, default_result
from _protocol import Arm, Criterion, Experiment, paired_interval, run_experiment
from _protocol import _write_json as write_json
from adaln_learning_check import imputation_predictors, score_points

from dplightning import DPStrategy
from dplightning.callbacks import AdaLNBindFractions
from dplightning.callbacks._statistics import hill_tail_index
from dplightning.data import ETTDataModule
from dplightning.data.ett import WindowDataset
from dplightning.methods.adaln_bounds import calibrate_bounds, calibration_windows, vacuity
from dplightning.models import TimeSeriesDiT
from dplightning.models.dit_ts import CONDITIONING_PATTERNS
from dplightning.tasks import DPTimeSeriesDiffusion

DATA = "../shared/data/ett/ETTh1.csv"
BOUNDS_DIR = Path(__file__).resolve().parent.parent / "configs" / "timeseries"
CALIBRATIONS = {  # name -> how the calibration model trains on the validation months
    "heldout": "non-private (pre-registered first)",
    "matched": "DP-SGD at the condition's sigma, C and expected batch (pre-registered second, after 'heldout' was "
    "vacuous under DP); non-private conditions use the heldout bounds",
    "matched_lr": "trained like the arm: DP-SGD at the condition's sigma (none without DP), C, expected batch AND the "
    "arm's learning rate, one calibration per grid point (pre-registered third, after 'matched', calibrated at lr "
    "1e-3, bound on 30-54 % under the selected lr 3e-3)",
}
NET: dict[str, Any] = {"hidden": 64, "depth": 2, "heads": 4, "mlp_ratio": 2.0, "patch_size": 8,
                       "context_path": "tokens_and_c", "context_encoder": "mean"}  # fmt: skip
MODULE: dict[str, Any] = {"parameterization": "v", "center": "context_mean", "clip_denoised": 5.0}
FAULTS: dict[str, Any] = {"fault_kinds": ("unit", "missing"), "fault_unit_factors": (10.0,), "fault_seed": 0}
MAX_GRAD_NORM, MISSING, LRS = 1.0, 0.25, (1e-3, 3e-3)
PREMISE_CLEAN = 256  # clean training windows beside every faulted one in the premise diagnostics
TUNING_SEEDS, FINAL_SEEDS = (100,), (0, 1, 2, 3, 4)

VANILLA, AWARE = "DP-vanilla", "DP-aware"
ARMS: dict[str, dict[str, Any]] = {  # name -> (which bounds, their mode)
    VANILLA: {"bounds": (), "mode": "soft"},
    AWARE: {"bounds": ("c", "mod"), "mode": "soft"},
    "DP-aware hard": {"bounds": ("c", "mod"), "mode": "hard"},
    "DP-aware c-only": {"bounds": ("c",), "mode": "soft"},
    "DP-aware modulation-only": {"bounds": ("mod",), "mode": "soft"},
    "vanilla": {"bounds": (), "mode": "soft"},
    "aware": {"bounds": ("c", "mod"), "mode": "soft"},
}


@dataclasses.dataclass(frozen=True)
class Condition:
    """One experiment's privacy and fault setting, and its arms (``sigma=None``: no DP at all)."""

    sigma: float | None
    fault_rate: float
    arms: tuple[str, ...]
    tuned: bool = False  # False: the arms reuse main's selected lr (stated in the records)


CONDITIONS: dict[str, Condition] = {  # run in this order: the most important first
    "main": Condition(0.5, 0.03, (VANILLA, AWARE), tuned=True),
    "null": Condition(0.5, 0.0, (VANILLA, AWARE)),
    "nonprivate": Condition(None, 0.03, ("vanilla", "aware"), tuned=True),
    "sigma0.1": Condition(0.1, 0.03, (VANILLA, AWARE)),
    "ablation": Condition(0.5, 0.03, (VANILLA, "DP-aware hard", "DP-aware c-only", "DP-aware modulation-only")),
    "p1": Condition(0.5, 0.01, (VANILLA, AWARE)),
    "sigma0": Condition(0.0, 0.03, (VANILLA, AWARE)),
    # Added before its runs: under the lr-matched calibration DP-aware is vacuous at sigma = 0.5 (so would its
    # ablations be) and not at sigma = 0.1; DP-vanilla borrowed from sigma0.1.
    "ablation0.1": Condition(0.1, 0.03, (VANILLA, "DP-aware hard", "DP-aware c-only", "DP-aware modulation-only")),
    "null0.1": Condition(0.1, 0.0, (VANILLA, AWARE)),  # the expected null where the bounds are not vacuous
    "p1_0.1": Condition(0.1, 0.01, (VANILLA, AWARE)),  # item 4's p = 1 %, where the bounds are not vacuous
}
BORROWS = {"ablation": "main", "ablation0.1": "sigma0.1"}  # experiment -> where its DP-vanilla runs come from

CLAIMS = {
    "vacuity": "an aware arm whose bounds bind, averaged over its 5 final runs (run-pooled shares), on < 1 % or "
    "> 20 % of examples (projection) or < 1 % or > 10 % of coordinates (any of gamma, beta, alpha) is vacuous: "
    "its CRPS is not reported as a result",
    "i": "premise (main, DP-vanilla, after training, training windows): the Hill tail index of the per-example "
    "gradient norms of the conditioning path is below the rest's in >= 4 of 5 seeds, AND the conditioning "
    "path's mean share of the squared norm is higher on faulted windows than on clean ones in >= 4 of 5 seeds",
    "ii": "both DP arms beat the trivial baselines (train mean, LOCF): the upper 90 % t-bound of the arm's mean "
    "clean-test CRPS over the 5 seeds is below each baseline's CRPS",
    "iii": "DP-aware's clean-test CRPS is lower than DP-vanilla's in >= 4 of 5 paired seeds AND the mean paired "
    "difference (vanilla - aware) exceeds 2 paired standard errors",
    "iv": "non-private aware's mean clean-test CRPS exceeds non-private vanilla's by at most 1 paired standard "
    "error (lower is not a failure)",
}


@dataclasses.dataclass(frozen=True)
class Budget:
    """Run lengths (the real design, or the smoke run's tiny ones)."""

    steps: int = 600
    batch: int = 64
    test_windows: int = 512
    val_windows: int = 128
    samples: int = 16
    calibration_steps: int = 600


SMOKE = Budget(steps=4, batch=16, test_windows=8, val_windows=8, samples=2, calibration_steps=30)


# ------------------------------------------------------------------ data, model, bounds


def data_module(
    data: str, budget: Budget, fault_rate: float, split: str, test_fault_rate: float = 0.0
) -> ETTDataModule:
    """ETTh1 imputation windows; ``split="val"`` makes the test loop score validation windows (never faulted)."""
    dm = ETTDataModule(data, task="imputation", input_len=96, batch_size=budget.batch,
                       max_test_windows=budget.test_windows, eval_batch_size=64, fault_rate=fault_rate,
                       test_fault_rate=test_fault_rate, **FAULTS)  # fmt: skip
    dm.setup()
    if split == "val":
        dm.test_set = WindowDataset(dm.splits["val"], dm.window, max_windows=budget.val_windows)
    return dm


def build_module(arm: str, bounds: Mapping[str, float], lr: float, samples: int) -> DPTimeSeriesDiffusion:
    """The arm's module: the shared network, with the calibrated bounds the arm has."""
    which, mode = ARMS[arm]["bounds"], ARMS[arm]["mode"]
    limits: dict[str, float] = {}
    if "c" in which:
        limits["c_max"] = bounds["c_max"]
    if "mod" in which:
        limits |= {k: bounds[k] for k in ("gamma_max", "beta_max", "alpha_max")}
    net = TimeSeriesDiT(**NET, window=96, bound_mode=mode, **limits)
    return DPTimeSeriesDiffusion(
        net, task="imputation", eval_missing_ratio=MISSING, n_samples=samples, **MODULE,
        optimizer=functools.partial(torch.optim.Adam, lr=lr),
    )  # fmt: skip


def bounds_file(folder: Path, calibration: str, sigma: float | None, lr: float = LRS[0]) -> Path:
    """Where the frozen bounds of a calibration, noise level (and, for ``matched_lr``, learning rate) live."""
    if calibration == "matched_lr":
        regime = "" if sigma is None else f"_dp_sigma{sigma:g}"
        return folder / f"bounds_etth1_imputation{regime}_lr{lr:g}.yaml"
    if calibration == "heldout" or sigma is None:
        return folder / "bounds_etth1_imputation.yaml"
    return folder / f"bounds_etth1_imputation_dp_sigma{sigma:g}.yaml"


def frozen_bounds(
    data: str, budget: Budget, path: Path, sigma: float | None = None, lr: float = LRS[0]
) -> dict[str, float]:
    """The bounds in ``path``; if absent, calibrated on the validation months first (DP-SGD at ``sigma`` if
    given; Adam at ``lr``: the first two calibrations used the grid's first point for every arm)."""
    if path.exists():
        return dict(yaml.safe_load(path.read_text())["model"]["init_args"]["model"]["init_args"])
    template = build_module(AWARE, {"c_max": 1.0, "gamma_max": 1.0, "beta_max": 1.0, "alpha_max": 1.0}, lr, 1)
    dm = data_module(data, budget, 0.0, "test")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        calibrated = calibrate_bounds(template, calibration_windows(dm), steps=budget.calibration_steps,
                                      batch_size=budget.batch, seed=0, noise_multiplier=sigma,
                                      max_grad_norm=MAX_GRAD_NORM)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(calibrated.to_yaml("python benchmarks/adaln_protocol.py (frozen_bounds)"))
    return calibrated.init_args()


# ------------------------------------------------------------------ premise diagnostics (not private)


def premise(
    module: DPTimeSeriesDiffusion, dm: ETTDataModule, clean: int = PREMISE_CLEAN, faulted_cap: int | None = None
) -> dict[str, float]:
    """Per-example gradient norms of the conditioning path and of the rest, after training, by backward loop.

    On every faulted training window (the first ``faulted_cap``, if given) and ``clean`` evenly spaced clean
    ones, each with its own t, ε and training mask drawn from a generator seeded by the window's index (the
    same draws for every arm).
    """
    train = dm.train_set
    faulted = sorted(getattr(train, "faults", {}))[:faulted_cap]
    clean_ids = [i for i in np.linspace(0, len(train) - 1, clean + len(faulted)).astype(int).tolist()
                 if i not in set(faulted)][:clean]  # fmt: skip
    names = [n for n, p in module.model.named_parameters() if p.requires_grad]
    is_cond = np.array([any(fnmatch.fnmatch(n, pat) for pat in CONDITIONING_PATTERNS) for n in names])
    params = [p for p in module.model.parameters() if p.requires_grad]
    rows: list[tuple[float, float, bool]] = []
    for i in faulted + clean_ids:
        item = train[i]
        batch = [t.unsqueeze(0) for t in item] if isinstance(item, tuple) else item.unsqueeze(0)
        x, observed, target = module.unpack_windows(batch)
        g = torch.Generator().manual_seed(10_000 + i)
        cond = module.conditioning_mask(observed, g)
        loss = module.per_example_loss(x, observed, cond, g, target).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        sq = np.array([0.0 if gr is None else float(gr.double().pow(2).sum()) for gr in grads])
        rows.append((float(sq[is_cond].sum()), float(sq[~is_cond].sum()), i in faulted))
    cond_sq, rest_sq, is_faulted = (np.array(c) for c in zip(*rows))
    total = np.sqrt(cond_sq + rest_sq)
    share = cond_sq / np.maximum(cond_sq + rest_sq, 1e-30)
    out = {
        "hill_cond": hill_tail_index(np.sqrt(cond_sq)),
        "hill_rest": hill_tail_index(np.sqrt(rest_sq)),
        "share_clean": float(share[~is_faulted].mean()),
        "clip_rate_clean": float((total[~is_faulted] > MAX_GRAD_NORM).mean()),
    }
    if is_faulted.any():
        out |= {"share_faulted": float(share[is_faulted].mean()),
                "clip_rate_faulted": float((total[is_faulted] > MAX_GRAD_NORM).mean())}  # fmt: skip
    return out


# ------------------------------------------------------------------ one run


def accountant(sigma: float | None) -> str:
    """PRV (the default), except at sigma < 0.3, where PRV takes minutes per epsilon: RDP (an upper bound)."""
    return "rdp" if sigma is not None and sigma < 0.3 else "prv"


def run_arm(data: str, budget: Budget, bounds: Mapping[float, Mapping[str, float]], condition: Condition, arm: str,
            hparams: Mapping[str, Any], seed: int, split: str) -> dict[str, float]:  # fmt: skip
    """Train one arm; CRPS (de-normalised) on ``split``'s clean windows, and on faulted test windows.

    ``bounds`` maps the learning rate to the frozen bounds an aware arm trained at it uses.
    """
    pl.seed_everything(seed, verbose=False)
    lr = float(hparams["lr"])
    module = build_module(arm, bounds[lr] if ARMS[arm]["bounds"] else {}, lr, budget.samples)
    dm = data_module(data, budget, condition.fault_rate, split)
    private = condition.sigma is not None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*seed= is FOR TESTS ONLY.*")  # paired on purpose
        strategy: Any = (DPStrategy(noise_multiplier=condition.sigma, max_grad_norm=MAX_GRAD_NORM, seed=seed,
                                    accountant=accountant(condition.sigma)) if private else "auto")  # fmt: skip
        bind = AdaLNBindFractions(every_n_steps=50) if ARMS[arm]["bounds"] else None
        trainer = quiet_trainer(strategy=strategy, max_steps=budget.steps, max_epochs=-1, limit_val_batches=0,
                                num_sanity_val_steps=0, callbacks=[bind] if bind else [])  # fmt: skip
        start = time.perf_counter()
        trainer.fit(module, datamodule=dm)
        metrics: dict[str, float] = {"fit_seconds": time.perf_counter() - start}
    if private:
        metrics |= {"delta": strategy.dp_state.delta, "sample_rate": strategy.dp_state.sample_rate}
        epsilon = strategy.get_epsilon()
        if math.isfinite(epsilon):  # sigma = 0 gives inf, which is in the settings (a metric of inf has no sd)
            metrics["epsilon"] = epsilon
    start = time.perf_counter()
    torch.manual_seed(seed)
    (scored,) = trainer.test(module, dm, verbose=False)
    metrics |= {k.removeprefix("test_"): float(v) for k, v in scored.items()}
    if split == "test":
        torch.manual_seed(seed)
        (faulted,) = trainer.test(module, data_module(data, budget, condition.fault_rate, split, 1.0), verbose=False)
        metrics |= {f"{k.removeprefix('test_')}_faulted": float(v) for k, v in faulted.items()}
        module.eval()
        clean, cap = (PREMISE_CLEAN, None) if budget != SMOKE else (40, 8)  # the smoke run: the code path only
        # a statistic without a value (a Hill index of too few norms) stays out: the protocol takes sds of metrics
        metrics |= {f"premise_{k}": v for k, v in premise(module, dm, clean, cap).items() if math.isfinite(v)}
    metrics["test_seconds"] = time.perf_counter() - start
    if bind is not None:
        fractions = bind.run_fractions
        metrics |= {f"bind_{k}": v for k, v in fractions.items()}
        metrics["vacuous"] = float(vacuity(fractions).vacuous)
    return metrics


# ------------------------------------------------------------------ experiments and claims


def experiment(name: str, data: str, budget: Budget, bounds: Mapping[float, Mapping[str, float]],
               selected: Mapping[str, float], calibration: str = "heldout") -> Experiment:  # fmt: skip
    """The protocol experiment of one condition; untuned conditions take ``selected`` (arm -> lr).

    ``bounds``: learning rate -> the frozen bounds of the aware arms at it (the same for every lr, except
    under the ``matched_lr`` calibration).
    """
    condition = CONDITIONS[name]
    arms = []
    for arm in condition.arms:
        run = functools.partial(run_arm, data, budget, bounds, condition, arm)
        if condition.tuned or (name == "ablation" and arm == VANILLA):  # ablation borrows main's tuned DP-vanilla
            arms.append(Arm(arm, run, [{"lr": lr} for lr in LRS]))
        else:
            source = VANILLA if arm == VANILLA else AWARE  # ablations take DP-aware's lr
            arms.append(Arm(arm, run, [{"lr": selected[source]}],
                            fixed=f"lr selected for {source} by the pre-registered experiment 'main'"))  # fmt: skip
    reference = condition.arms[0]
    return Experiment(
        name=name, arms=arms, criteria=[Criterion(a, reference) for a in condition.arms[1:]], metric="crps",
        higher_is_better=False, tuning_seeds=TUNING_SEEDS, final_seeds=FINAL_SEEDS,
        settings={"sigma": condition.sigma, "fault_rate": condition.fault_rate,
                  **({"accountant": "rdp"} if accountant(condition.sigma) == "rdp" else {}),
                  "arms": {arm: {k: list(v) if isinstance(v, tuple) else v for k, v in ARMS[arm].items()}
                           for arm in condition.arms},
                  "budget": dataclasses.asdict(budget), "net": NET,
                  "module": MODULE, "faults": {k: list(v) if isinstance(v, tuple) else v for k, v in FAULTS.items()},
                  "bounds": _bounds_setting(bounds, calibration), "max_grad_norm": MAX_GRAD_NORM,
                  "missing_ratio": MISSING,
                  "privacy_unit": "one window of 96 consecutive hourly rows (7 channels); windows overlap, so one "
                  "row lies in up to 96 windows and its privacy is NOT what epsilon states",
                  "claims": CLAIMS,
                  # the first calibration's records predate this key: it is set only for the second
                  **({"calibration": CALIBRATIONS[calibration]} if calibration != "heldout" else {})},
    )  # fmt: skip


def _bounds_setting(bounds: Mapping[float, Mapping[str, float]], calibration: str) -> dict[str, Any]:
    """The bounds as the record states them: one set (the first two calibrations' records), or one per lr."""
    if calibration != "matched_lr":
        (one,) = {json.dumps(dict(b), sort_keys=True) for b in bounds.values()}
        return json.loads(one)
    return {f"lr={lr:g}": dict(b) for lr, b in sorted(bounds.items())}


def final_values(record: Mapping[str, Any], arm: str, metric: str) -> list[float]:
    """The arm's final-run values of ``metric``, in final-seed order."""
    runs = {r["seed"]: r["metrics"] for r in record["runs"] if r["phase"] == "final" and r["arm"] == arm}
    return [float(runs[s][metric]) for s in sorted(runs) if metric in runs[s]]


def judge(records: Mapping[str, Mapping[str, Any]], baselines: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """The pre-registered criteria (i)–(iv) and the vacuity rule on the complete records."""
    out: dict[str, Any] = {"claims": CLAIMS}
    main = records.get("main")
    if main is None:
        return out
    vac = {}
    for name, record in records.items():
        for arm in CONDITIONS[name].arms:
            if not ARMS[arm]["bounds"]:
                continue
            fractions = {k: statistics.fmean(final_values(record, arm, f"bind_{k}"))
                         for k in ("projection", "gamma", "beta", "alpha")
                         if final_values(record, arm, f"bind_{k}")}  # fmt: skip
            if fractions:
                verdict = vacuity(fractions)
                vac[f"{name}/{arm}"] = {"vacuous": verdict.vacuous, "reasons": list(verdict.reasons),
                                        "fractions": fractions}  # fmt: skip
    out["vacuity"] = vac
    private = {name: record for name, record in records.items() if CONDITIONS[name].sigma is not None}
    # The pre-registered (i) and (ii) are main's; the other DP experiments are reported by the same rules.
    out["i_by_experiment"] = {name: _premise(record) for name, record in private.items()}
    out["ii_by_experiment"] = {name: _beats_baselines(record, baselines) for name, record in private.items()}
    out["i"], out["ii"] = out["i_by_experiment"]["main"], out["ii_by_experiment"]["main"]
    out["iii"] = {f"{name}/{arm}": _paired_rule(record, CONDITIONS[name].arms[0], arm, vac.get(f"{name}/{arm}"))
                  for name, record in records.items() if name != "nonprivate"
                  for arm in CONDITIONS[name].arms[1:]}  # fmt: skip
    if "nonprivate" in records:
        v, a = (final_values(records["nonprivate"], arm, "crps") for arm in ("vanilla", "aware"))
        diffs = [y - x for x, y in zip(v, a)]
        se = _standard_error(diffs)
        out["iv"] = {"passed": statistics.fmean(diffs) <= se, "mean_aware_minus_vanilla": statistics.fmean(diffs),
                     "se": se}  # fmt: skip
        if vac.get("nonprivate/aware", {}).get("vacuous"):
            out["iv"] |= {"passed": False, "vacuous": True, "note": "vacuous arm: not reported as a result"}
    return out


def _premise(record: Mapping[str, Any]) -> dict[str, Any]:
    """Criterion (i) on one experiment's DP-vanilla final runs."""
    hc, hr = final_values(record, VANILLA, "premise_hill_cond"), final_values(record, VANILLA, "premise_hill_rest")
    sf = final_values(record, VANILLA, "premise_share_faulted")
    sc = final_values(record, VANILLA, "premise_share_clean")
    tail, share = sum(a < b for a, b in zip(hc, hr)), sum(a > b for a, b in zip(sf, sc))
    return {"passed": tail >= 4 and share >= 4, "tail_lower_in": tail, "share_higher_in": share,
            "hill_cond": hc, "hill_rest": hr, "share_faulted": sf, "share_clean": sc}  # fmt: skip


def _beats_baselines(record: Mapping[str, Any], baselines: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """Criterion (ii) on one experiment's DP-vanilla and DP-aware final runs."""
    ii: dict[str, Any] = {}
    for arm in (VANILLA, AWARE):
        if not (values := final_values(record, arm, "crps")):
            continue
        upper = paired_interval(values)["high"]  # the one-sided 95 % = the two-sided 90 % t-bound's upper end
        ii[arm] = {"mean": statistics.fmean(values), "upper90": upper,
                   "beats": {b: upper < baselines[b]["crps"] for b in ("train_mean", "locf")}}  # fmt: skip
    return {"passed": bool(ii) and all(all(v["beats"].values()) for v in ii.values()), **ii}


def _paired_rule(record: Mapping[str, Any], reference: str, arm: str, vac: Mapping[str, Any] | None) -> dict[str, Any]:
    """Criterion (iii) for ``arm`` against ``reference`` (lower CRPS is better)."""
    ref, new = final_values(record, reference, "crps"), final_values(record, arm, "crps")
    diffs = [r - n for r, n in zip(ref, new)]  # > 0: the arm is better
    se = _standard_error(diffs)
    wins, mean = sum(d > 0 for d in diffs), statistics.fmean(diffs)
    result = {"wins": wins, "mean_improvement": mean, "se": se, "interval90": paired_interval(diffs),
              "passed": wins >= 4 and mean > 2 * se}  # fmt: skip
    if vac and vac["vacuous"]:
        result |= {"passed": False, "vacuous": True, "note": "vacuous arm: not reported as a result"}
    return result


def _standard_error(diffs: Sequence[float]) -> float:
    """The paired standard error of criteria (iii) and (iv)."""
    return statistics.stdev(diffs) / math.sqrt(len(diffs))


def baselines(data: str, budget: Budget) -> dict[str, dict[str, float]]:
    """Point baselines on the clean test windows and masks the module scores (CRPS de-normalised)."""
    dm = data_module(data, budget, 0.0, "test")
    module = build_module(VANILLA, {}, LRS[0], 1)
    batches = [(x, module.evaluation_mask(torch.ones_like(x), i)) for i, x in enumerate(dm.test_dataloader())]
    predictors = imputation_predictors(dm, MISSING)
    return {name: score_points([fn(x, c) for x, c in batches], batches, dm) for name, fn in predictors.items()}


SUMMARY_METRICS = ("crps", "crps_faulted", "mse")
BIND_KINDS = ("projection", "gamma", "beta", "alpha")


def summary(first: str) -> str:
    """One markdown table over every complete record of every calibration under the prefix ``first``.

    Per experiment and arm: the selected lr, mean ± sd of the metrics over the final seeds, the run-pooled
    bind fractions (mean over the final runs) and the vacuity verdict; per pair, the paired difference of
    CRPS (arm - reference; > 0: the arm is worse) with its 90 % interval.
    """
    head = "calibration | experiment | arm | lr | ε | CRPS | CRPS faulted | MSE | binds: proj / γ / β / α | vacuous"
    lines = [f"| {head} | CRPS arm − reference [90 % CI] |", "|" + "---|" * 11]
    for calibration in CALIBRATIONS:
        prefix = first if calibration == "heldout" else f"{first}_{calibration}"
        for name, condition in CONDITIONS.items():
            path = Path(f"{prefix}_{name}.json")
            if not path.exists() or (record := json.loads(path.read_text())).get("status") != "complete":
                continue
            reference = condition.arms[0]
            for arm in condition.arms:
                metrics = record["arms"][arm]["metrics"]
                shown = [f"{metrics[m]['mean']:.4f} ± {metrics[m]['sd']:.4f}" for m in SUMMARY_METRICS]
                eps = (
                    f"{metrics['epsilon']['mean']:.2f}"
                    if "epsilon" in metrics
                    else ("∞" if condition.sigma == 0 else "—")
                )
                binds = {k: v for k in BIND_KINDS if (v := final_values(record, arm, f"bind_{k}"))}  # the arm's bounds
                bind = " / ".join(
                    f"{100 * statistics.fmean(binds[k]):.2f} %" if k in binds else "–" for k in BIND_KINDS
                )
                verdict = "—"
                if binds:
                    verdict = "yes" if vacuity({k: statistics.fmean(v) for k, v in binds.items()}).vacuous else "no"
                else:
                    bind = "—"
                pair = "—"
                if arm != reference:
                    ref, new = final_values(record, reference, "crps"), final_values(record, arm, "crps")
                    ci = paired_interval([n - r for r, n in zip(ref, new)])
                    pair = f"{ci['mean']:+.4f} [{ci['low']:+.4f}, {ci['high']:+.4f}]"
                lr = record["selection"][arm]["hparams"]["lr"]
                lines.append(f"| {calibration} | {name} | {arm} | {lr:g} | {eps} | {' | '.join(shown)} | {bind} | "
                             f"{verdict} | {pair} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--smoke", action="store_true", help="tiny runs: the code path, no result")
    parser.add_argument("--only", nargs="+", choices=list(CONDITIONS), help="run these experiments (main first)")
    parser.add_argument("--out", type=str, default=None, help="the records' prefix (default: outputs/benchmarks/)")
    parser.add_argument("--figures", type=Path, default=None, help="the figure folder (default: outputs/figures/)")
    parser.add_argument("--bounds-dir", type=Path, default=None, help="frozen bounds (default: configs/timeseries/)")
    parser.add_argument("--calibration", default="heldout", choices=list(CALIBRATIONS), help="how the bounds are set")
    parser.add_argument("--workers", type=int, default=1, help="runs at once, one thread each (forked processes)")
    parser.add_argument("--summary", action="store_true", help="only tabulate the complete records (NAME_summary.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    budget = SMOKE if args.smoke else Budget()
    first = (args.out or str(default_result(f"adaln_etth1{'_smoke' if args.smoke else ''}"))).removesuffix(".json")
    prefix = first if args.calibration == "heldout" else f"{first}_{args.calibration}"
    figures = args.figures or default_figures()
    if args.summary:
        table = summary(first)
        Path(first).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{first}_summary.md").write_text(table)
        print(table)
        return {"summary": table}
    folder = args.bounds_dir or (Path(first).parent if args.smoke else BOUNDS_DIR)
    calibrated: dict[tuple[float | None, float], dict[str, float]] = {}

    def bounds_of(sigma: float | None, lrs: Sequence[float]) -> dict[float, dict[str, float]]:
        """lr -> bounds: one calibration per lr under matched_lr, else one for all (at the grid's first lr)."""
        out = {}
        for lr in lrs:
            at = lr if args.calibration == "matched_lr" else LRS[0]
            if (sigma, at) not in calibrated:
                path = bounds_file(folder, args.calibration, sigma, at)
                dp = sigma if args.calibration in ("matched", "matched_lr") else None
                calibrated[sigma, at] = frozen_bounds(args.data, budget, path, dp, at)
            out[lr] = calibrated[sigma, at]
        return out

    base = baselines(args.data, budget)
    records: dict[str, dict[str, Any]] = {}
    selected: dict[str, float] = {}
    for name in args.only or list(CONDITIONS):
        if name != "main" and not CONDITIONS[name].tuned and not selected:
            main_record = json.loads(Path(f"{prefix}_main.json").read_text())
            selected = {a: s["hparams"]["lr"] for a, s in main_record["selection"].items()}
        sigma = CONDITIONS[name].sigma
        # Without DP the first two calibrations are the same non-private one: the second reuses the first's record.
        at, calibration = (
            (first, "heldout") if sigma is None and args.calibration == "matched" else (prefix, args.calibration)
        )
        lrs = LRS if CONDITIONS[name].tuned or name == "ablation" else [selected[AWARE]]  # ablation: main's bounds
        exp = experiment(name, args.data, budget, bounds_of(sigma, lrs), selected, calibration)
        borrow = {VANILLA: Path(f"{at}_{BORROWS[name]}.json")} if name in BORROWS else None
        exp = dataclasses.replace(exp, name=f"{Path(at).name}_{name}")
        records[name] = run_experiment(exp, out=Path(f"{at}_{name}.json"), figures=figures, threads=1,
                                       workers=args.workers, borrow=borrow)  # fmt: skip
        if name == "main":
            selected = {a: s["hparams"]["lr"] for a, s in records[name]["selection"].items()}
        claims = {"calibration": CALIBRATIONS[args.calibration], "baselines": base,
                  "bounds": {f"sigma={s},lr={lr:g}": b for (s, lr), b in calibrated.items()},
                  **judge(records, base)}  # fmt: skip
        write_json(Path(f"{prefix}_claims.json"), claims)
    print(json.dumps({k: v for k, v in claims.items() if k not in ("claims",)}, indent=1, default=str))
    return claims


if __name__ == "__main__":
    main()
