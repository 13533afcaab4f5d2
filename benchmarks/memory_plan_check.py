"""Validate ``dplightning memory-plan`` against the measured peak of real DP steps on CPU.

    OMP_NUM_THREADS=1 python benchmarks/memory_plan_check.py            # all cases
    OMP_NUM_THREADS=1 python benchmarks/memory_plan_check.py --cases gpt2_full

Each case is a fit config (as a mapping, the form the planner reads): a tiny GPT-2 or OPT
built from a ``config`` mapping, full fine-tuning or LoRA, under ``dplightning.DPStrategy``
(σ = 1, C = 1, flat clipping, ``clipping_engine=auto``) and AdamW. The data are synthetic
token batches of exactly ``max_length`` tokens, with ``poisson_sampling=False`` so that every
batch has exactly ``batch_size`` rows: the plan is then compared at the shape it assumes
(no Poisson margin). Three steps run: the first two verify gradients (autograd's ``p.grad``
is kept), the third is a steady step; the ``*_steady`` and ``*_replay`` cases verify none, so
all three are steady (``*_replay``: ``clip_replay=True``).

**How the peak is measured.** CPU tensors have no allocator statistics, and peak RSS mixes in
the interpreter, libraries and the allocator's retention. Each case runs in a fresh process
under ``torch.profiler.profile(profile_memory=True)``, started before the model is built:
the profiler then records every allocation and free of the CPU allocator with the running
total of bytes allocated (``Total Allocated`` of the ``[memory]`` events), which is the live
size of every tensor storage (and of ATen's own CPU workspaces). The peak is the largest
running total during ``trainer.fit``; the total just before fit (weights and the module's
other tensors) is reported as well. The estimate is the planner's ``peak`` for the same config.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import provenance
from _outputs import default_result

ROOT = Path(__file__).resolve().parents[1]

_GPT2 = {"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 4096, "n_positions": 128}
_OPT = {
    "model_type": "opt",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "ffn_dim": 1024,
    "word_embed_proj_dim": 256,
    "vocab_size": 4096,
    "max_position_embeddings": 128,
}
_LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def case_config(
    model: dict[str, Any],
    lora: dict[str, Any] | None,
    precision: str = "32-true",
    optimizer: dict[str, Any] | None = None,
    **strategy: Any,
) -> dict[str, Any]:
    """A fit config mapping for one case (batch 16 x 64 tokens); ``strategy``: more DPStrategy arguments."""
    init: dict[str, Any] = {"config": model}
    if lora is not None:
        init["lora"] = lora
    if optimizer is not None:
        init["optimizer"] = optimizer
    return {
        "trainer": {
            "accelerator": "cpu",
            "precision": precision,
            "strategy": {
                "class_path": "dplightning.DPStrategy",
                "init_args": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "poisson_sampling": False, **strategy},
            },
        },
        "model": {"class_path": "dplightning.tasks.DPCausalLM", "init_args": init},
        "data": {"init_args": {"batch_size": 16, "max_length": 64}},
    }


CASES = {
    "gpt2_full": case_config(_GPT2, None),
    "opt_full": case_config(_OPT, None),
    "opt_lora": case_config(_OPT, _LORA),
    "gpt2_full_bf16": case_config(_GPT2, None, "bf16-mixed"),
    "opt_dp_grape": case_config(_OPT, None, optimizer={"class_path": "dplightning.optim.DPGrape", "init_args": {}}),
    # Steady steps only (no verification), in one backward pass and in two (clip_replay).
    "gpt2_steady": case_config(_GPT2, None, verify_gradients="never"),
    "gpt2_replay": case_config(_GPT2, None, verify_gradients="never", clip_replay=True),
    "opt_replay": case_config(_OPT, None, verify_gradients="never", clip_replay=True),
}


def _datamodule(batch_size: int, tokens: int, vocab: int) -> Any:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    class Tokens(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            ids = torch.randint(4, vocab, (batch_size * 8, tokens), generator=torch.Generator().manual_seed(0))
            rows = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]
            return DataLoader(rows, batch_size=batch_size, shuffle=True)  # type: ignore[arg-type]

    return Tokens()


def _optimizer(model_args: dict[str, Any]) -> Any:
    """The case's optimizer as a callable of the parameters (``None``: the module's default)."""
    import functools
    import importlib

    spec = model_args.get("optimizer")
    if spec is None:
        return None
    module, _, name = spec["class_path"].rpartition(".")
    return functools.partial(getattr(importlib.import_module(module), name), **spec.get("init_args", {}))


def _trace_peak(trace: Path) -> float:
    events = json.loads(trace.read_text())["traceEvents"]
    totals = [
        e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == 0
    ]
    return float(max(totals, default=0))


def measure(config: dict[str, Any], steps: int = 3) -> dict[str, float]:
    """Peak and pre-fit live CPU tensor bytes of ``steps`` DP steps of ``config`` (this process)."""
    import torch
    from _harness import quiet_trainer
    from torch.profiler import ProfilerActivity, profile

    import dplightning
    from dplightning.tasks import DPCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = config["data"]["init_args"]
    model_args = config["model"]["init_args"]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        module = DPCausalLM(config=model_args["config"], lora=model_args.get("lora"), optimizer=_optimizer(model_args))
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=1,
            precision=config["trainer"]["precision"],
            strategy=dplightning.DPStrategy(**config["trainer"]["strategy"]["init_args"]),
            max_steps=steps,
        )
        prebuilt = sum(t.untyped_storage().nbytes() for t in module.state_dict(keep_vars=True).values())
        trainer.fit(
            module, datamodule=_datamodule(data["batch_size"], data["max_length"], model_args["config"]["vocab_size"])
        )
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        peak = _trace_peak(trace)
    return {"measured_peak_bytes": peak, "module_tensor_bytes": float(prebuilt)}


def estimate(config: dict[str, Any]) -> dict[str, Any]:
    """The planner's view of ``config``."""
    from dplightning.planning.memory import plan

    p = plan(config)
    return {"estimated_peak_bytes": p.peak, "peak_phase": p.peak_phase, "plan": p.to_dict()}


def _run_case(name: str) -> dict[str, Any]:
    """One case in a fresh process (allocator totals and hooks never leak between cases)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--one", name], capture_output=True, text=True, env=env, cwd=ROOT, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _versions() -> dict[str, str]:
    import lightning
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "machine": "CPU (2-core AMD EPYC VM)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=default_result("memory_plan_cpu.json"))
    args = parser.parse_args()
    if args.one:
        result = {**measure(CASES[args.one]), **estimate(CASES[args.one])}
        print(json.dumps(result))
        return
    rows = []
    print(f"{'case':16} {'estimate MB':>12} {'measured MB':>12} {'error':>8}  phase")
    for name in args.cases:
        r = _run_case(name)
        err = r["estimated_peak_bytes"] / r["measured_peak_bytes"] - 1
        rows.append({"case": name, **r, "relative_error": err})
        est, got = r["estimated_peak_bytes"] / 1e6, r["measured_peak_bytes"] / 1e6
        print(f"{name:16} {est:12.1f} {got:12.1f} {100 * err:+7.1f}%  {r['peak_phase']}", flush=True)
    report = {**provenance(1), "cases_run": args.cases, "versions": _versions(), "cases": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
