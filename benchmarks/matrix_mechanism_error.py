"""Setup time and expected error of the correlated-noise strategies (no training; CPU, one thread).

    OMP_NUM_THREADS=1 python benchmarks/matrix_mechanism_error.py            # n = 10,000
    OMP_NUM_THREADS=1 python benchmarks/matrix_mechanism_error.py --n 2000 --bands 4 16

For each separation s (= the bands b of the banded strategy, as cyclic Poisson over b
partitions gives), every example participates at most ⌈n/s⌉ times, s steps apart. Reported per
workload (prefix sums = SGD, heavy-ball momentum 0.9): the seconds to optimise the b-banded
strategy and to fit a BLT with 1, 2 and 4 buffers for that participation (cold, no cache), and
each strategy's RMSE of the noisy workload divided by DP-SGD's (identity C) at the same σ and the
same participation, i.e. at equal privacy *without* amplification. The single-participation rows
(k = 1) compare with the same rule. With amplification σ depends on the strategy: the ratios are
not equal-ε comparisons.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dplightning.privacy.blt import fit_blt
from dplightning.privacy.matrix_mechanism import Workload, expected_error, identity_strategy, optimize_banded

try:
    from benchmarks._harness import provenance
    from benchmarks._outputs import default_result
except ImportError:  # run as a script from the repository root
    from _harness import provenance
    from _outputs import default_result


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def measure(n: int, bands: list[int], buffers: list[int]) -> list[dict]:
    """One row per (workload, separation, strategy)."""
    rows = []
    for name, workload in (("prefix", Workload()), ("momentum0.9", Workload(0.9))):
        for sep, count in [(b, None) for b in bands] + [(1, 1)]:
            sgd = expected_error(identity_strategy(n), workload, 1.0, sep, count)
            arms = []
            if count is None:
                arms.append((f"banded b={sep}", *_timed(optimize_banded.__wrapped__, workload, n, sep)))
            else:
                arms += [(f"banded b={b}", *_timed(optimize_banded.__wrapped__, workload, n, b)) for b in bands]
            arms += [(f"BLT {m}", *_timed(fit_blt.__wrapped__, workload, n, m, sep, count)) for m in buffers]
            for arm, strategy, seconds in arms:
                report = expected_error(strategy, workload, 1.0, sep, count)
                rows.append(
                    {
                        "workload": name,
                        "min_sep": sep,
                        "max_participations": count or -(-n // sep),
                        "strategy": arm,
                        "setup_s": round(seconds, 3),
                        "rmse_ratio_vs_dpsgd": report.rmse / sgd.rmse,
                        "max_rmse_ratio_vs_dpsgd": report.max_rmse / sgd.max_rmse,
                    }
                )
                print(
                    f"{name:12s} s={sep:<3d} k={rows[-1]['max_participations']:<6d} {arm:12s} "
                    f"setup {seconds:6.2f} s  RMSE/DP-SGD {report.rmse / sgd.rmse:.4f}",
                    flush=True,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--bands", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--buffers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=default_result("matrix_mechanism_error.json"))
    args = parser.parse_args()
    rows = measure(args.n, args.bands, args.buffers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"n": args.n, "sigma": 1.0, "rows": rows, **provenance(1)}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
