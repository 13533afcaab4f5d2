"""How close the trained DP-vanilla conditioning comes to the DP-aware bounds (σ = 1, seed 0, the validation windows).

OMP_NUM_THREADS=1 python benchmarks/dp_aware_adaln_bounds_check.py
"""

import sys
import warnings

import lightning.pytorch as pl
import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
sys.argv = sys.argv[:1]
sys.path.insert(0, "benchmarks")
import dp_aware_adaln as B  # noqa: E402
from _harness import quiet_trainer  # noqa: E402

import dplightning  # noqa: E402

args = B.parse_args()
for task in ["imputation", "forecasting"]:
    dm = B.build_data(args, task)
    pl.seed_everything(0, verbose=False)
    m = B.build_module(args, task, aware=False)
    tr = quiet_trainer(
        strategy=dplightning.DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=150, limit_val_batches=0
    )
    tr.fit(m, dm)
    x = torch.stack([dm.val_set[i] for i in range(0, len(dm.val_set), 1)])
    obs = torch.ones_like(x)
    g = torch.Generator().manual_seed(0)
    cond = m.conditioning_mask(obs, g)
    t = torch.randint(0, 50, (len(x),), generator=g)
    net = m.model
    with torch.no_grad():
        c = net.condition(t, cond * x, cond)
        raw = torch.cat([b.adaLN_modulation(c) for b in net.blocks], 1)
        cn = c.norm(dim=1)
        print(
            task,
            f"|c| p50 {cn.median():.3f} p99 {cn.quantile(0.99):.3f} max {cn.max():.3f} (c_max 8); "
            f"|raw mod| p99 {raw.abs().quantile(0.99):.3f} max {raw.abs().max():.3f} (bounds 1); "
            f"|t_emb| max {net.t_embedder(t).norm(dim=1).max():.3f}; "
            f"share |raw| > 0.5: {(raw.abs() > 0.5).float().mean():.4f}",
        )
        xo = x.clone()
        xo[:8] *= 100
        c2 = net.condition(t, cond * xo, cond)
        print("  context x100:", f"|c| max {c2.norm(dim=1).max():.1f}")
