"""``dplightning calibrate``: the noise multiplier σ for a target ε, without training.

dplightning calibrate --target-epsilon 3 --sample-rate 0.2 --steps 200 --delta 1e-5
dplightning calibrate --target-epsilon 3 --batch-size 256 --dataset-size 1258 --epochs 40

prints the σ that ``DPStrategy(target_epsilon=...)`` would calibrate for the same q, number
of steps, δ and accountant, and the ε it gives. With ``--batch-size`` and ``--dataset-size``,
q = batch_size / N (the batch size summed over processes), an epoch is ⌈1/q⌉ Poisson steps
as the strategy runs them, and δ defaults to the strategy's 1/(10·N). The σ is that of the
whole step: with step releases (e.g. a private clip fraction) it is σ_eff, and the gradient
gets the σ those releases leave (:func:`dplightning.privacy.split_noise_multiplier`).
"""

from __future__ import annotations

import argparse
import json
import math

from dplightning.privacy.accounting import available_accountants, calibrate_noise_multiplier, compute_epsilon
from dplightning.privacy.poisson import steps_per_epoch


def _sampling(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[float, int, float]:
    """(q, steps, δ) from the arguments, in one of the two forms."""
    if (args.sample_rate is None) == (args.batch_size is None):
        parser.error("give either --sample-rate or --batch-size with --dataset-size")
    if args.batch_size is not None and args.dataset_size is None:
        parser.error("--batch-size needs --dataset-size (q = batch_size / N)")
    q = args.sample_rate if args.sample_rate is not None else args.batch_size / args.dataset_size
    if not 0 < q <= 1:
        parser.error(f"the sample rate q = {q:.4g} must lie in (0, 1]")
    if (args.steps is None) == (args.epochs is None):
        parser.error("give either --steps or --epochs")
    steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch(q)
    delta = args.delta
    if delta is None:
        if args.dataset_size is None:
            parser.error("give --delta, or --dataset-size for the default δ = 1/(10·N)")
        delta = 1.0 / (10 * args.dataset_size)
    if not 0 < delta < 1:
        parser.error(f"--delta must lie in (0, 1), got {delta}")
    return q, steps, delta


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplightning calibrate``."""
    parser = argparse.ArgumentParser(prog="dplightning calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-epsilon", type=float, required=True, help="The ε to reach at the last step.")
    parser.add_argument("--sample-rate", type=float, help="Poisson sampling rate q of every step.")
    parser.add_argument("--batch-size", type=int, help="Expected batch size, all processes (with --dataset-size).")
    parser.add_argument("--dataset-size", type=int, help="Training set size N: q = batch_size / N, δ = 1/(10·N).")
    parser.add_argument("--steps", type=int, help="Number of DP steps (optimizer steps).")
    parser.add_argument("--epochs", type=int, help="Number of epochs of ⌈1/q⌉ Poisson steps each.")
    parser.add_argument("--delta", type=float, help="δ of the guarantee; default 1/(10·N) with --dataset-size.")
    parser.add_argument("--accountant", default="prv", choices=available_accountants(),
                        help="Opacus accountant, as DPStrategy(accountant=...) (default: %(default)s).")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    args = parser.parse_args(argv)
    q, steps, delta = _sampling(args, parser)
    sigma = calibrate_noise_multiplier(args.target_epsilon, delta, q, steps, args.accountant)
    epsilon = compute_epsilon([(sigma, q, steps)], delta, args.accountant)
    result = {"noise_multiplier": sigma, "epsilon": epsilon, "target_epsilon": args.target_epsilon,
              "delta": delta, "sample_rate": q, "steps": steps, "accountant": args.accountant}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"σ = {sigma:.6g} gives (ε = {epsilon:.4g}, δ = {delta:.3g}) for target ε = {args.target_epsilon} after "
            f"{steps} steps at q = {q:.4g} ({args.accountant} accountant)"
        )
    return 0 if math.isfinite(epsilon) and epsilon <= args.target_epsilon else 1
