"""``dplightning memory-plan``: the per-GPU memory of one DP training step, from fit configs.

    dplightning memory-plan --config configs/e2e/opt-6.7b_dpadam.yaml --gpu-memory 80GB
    python -m dplightning.commands.memory_plan --config task.yaml --config configs/cluster/dp_ddp_2x8gpu.yaml --json

The command only parses, prints and sets the exit status; the planner is :mod:`dplightning.planning.memory`.
Exit status: 0 if the step fits, 1 if it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from dplightning.planning.memory import (
    DEFAULT_SIGMAS,
    GB,
    assemble,
    header,
    load_configs,
    parse_memory,
    suggestion,
    survey,
    table,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dplightning memory-plan", description="Per-GPU memory of one DP training step, from fit configs."
    )
    parser.add_argument("--config", action="append", required=True, help="A fit YAML; repeat to merge in order.")
    parser.add_argument("--gpu-memory", default="80GB", help="GPU memory, e.g. 80GB, 80GiB, 24G (default 80GB).")
    parser.add_argument("--sigmas", type=float, default=DEFAULT_SIGMAS, help="Poisson margin in std devs above b.")
    parser.add_argument(
        "--reserve",
        default="auto",
        help="Memory kept out of the fit decision (CUDA context, fragmentation); auto: 1 GiB + 5%% of the GPU.",
    )
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplightning memory-plan``; returns 0 if the step fits, 1 if not, 2 on bad input."""
    args = _parser().parse_args(argv)
    try:
        capacity = parse_memory(args.gpu_memory)
        if capacity <= 0:
            raise ValueError("--gpu-memory must be positive.")
        reserve = 2**30 + 0.05 * capacity if args.reserve == "auto" else parse_memory(args.reserve)
        sv = survey(load_configs(args.config))
    except (ValueError, OSError) as error:
        print(f"memory-plan: {error}", file=sys.stderr)
        return 2
    result = assemble(sv, args.sigmas)
    verdict = suggestion(sv, result, capacity, reserve, args.sigmas)
    fits = result.fits(capacity, reserve)
    if args.json:
        out = {**result.to_dict(), "gpu_memory_bytes": capacity, "reserve_bytes": reserve, "fits": fits}
        print(json.dumps({**out, "suggestion": verdict}, indent=2))
    else:
        print(header(result))
        print(table(result))
        print(
            f"GPU {capacity / GB:.1f} GB, reserve {reserve / GB:.1f} GB (context, fragmentation): "
            + ("FITS." if fits else f"DOES NOT FIT -- {verdict}")
        )
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
