"""The old package name: a ``pytorch_lightning`` Trainer given a dplightning strategy is told why and what to change."""

from __future__ import annotations

import pytest

import dplightning

pl_legacy = pytest.importorskip("pytorch_lightning")  # installed with lightning 2.x

CAUSE = "dplightning works with the unified `lightning` package only"
FIX = "`import lightning.pytorch as pl` for `import pytorch_lightning as pl`"


@pytest.mark.parametrize("name", ["dp", "dp_ddp", "dp_ddp_spawn"])
def test_a_dp_strategy_name_in_a_pytorch_lightning_trainer_names_the_package(name: str) -> None:
    with pytest.raises(TypeError, match=f"strategy='{name}' is a dplightning strategy") as refusal:
        pl_legacy.Trainer(strategy=name, accelerator="cpu", logger=False)
    assert CAUSE in str(refusal.value) and FIX in str(refusal.value)


@pytest.mark.parametrize("strategy", [dplightning.DPStrategy, dplightning.DPDDPStrategy])
def test_a_dp_strategy_instance_in_a_pytorch_lightning_trainer_names_the_package(strategy: type) -> None:
    with pytest.raises(TypeError, match=f"strategy={strategy.__name__}\\(...\\) is a dplightning strategy") as refusal:
        pl_legacy.Trainer(strategy=strategy(noise_multiplier=1.0), accelerator="cpu", logger=False)
    assert CAUSE in str(refusal.value) and FIX in str(refusal.value)
    # The refusal reads only dplightning strategies: pytorch_lightning's own and lightning's still work.
    import lightning.pytorch as pl

    assert type(pl_legacy.Trainer(strategy="auto", accelerator="cpu", logger=False).strategy).__module__.startswith(
        "pytorch_lightning"
    )
    ddp = pl_legacy.Trainer(strategy="ddp", accelerator="cpu", devices=1, logger=False).strategy
    assert isinstance(ddp, pl_legacy.strategies.DDPStrategy)
    assert isinstance(pl.Trainer(strategy="dp", accelerator="cpu", logger=False).strategy, dplightning.DPStrategy)
