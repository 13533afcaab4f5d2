"""The dplightning command: shipped configs parse, and the quickstart runs end to end."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

import dplightning
from dplightning.cli import build_cli

CONFIG_DIR = Path(__file__).parents[1] / "configs"
OVERLAYS = sorted((CONFIG_DIR / "cluster").glob("*.yaml"))  # trainer-only files, combined with a task config
MODEL_OVERLAYS = {CONFIG_DIR / "finetune" / "lora_encoder.yaml": CONFIG_DIR / "finetune" / "sst2_minilm.yaml"}
# configs/muon/<task>_<optimizer>.yaml switches the optimizer of configs/finetune/<task>.yaml; the
# other files there are whole configs (a misnamed overlay is one too, and fails to parse on its own).
OPTIMIZER_OVERLAYS = {
    c: task
    for c in sorted(CONFIG_DIR.glob("muon/*.yaml"))
    if (task := CONFIG_DIR / "finetune" / f"{c.stem.rsplit('_', 1)[0]}.yaml").exists()
}
# configs/timeseries/bounds_*.yaml set DP-aware AdaLN-Zero's frozen bounds on an aware arm's config.
BOUNDS_OVERLAYS = sorted(CONFIG_DIR.glob("timeseries/bounds_*.yaml"))
AWARE_ARM = CONFIG_DIR / "timeseries" / "etth1_imputation_faults3_dp_aware_sigma0.5.yaml"
NOT_WHOLE = {*OVERLAYS, *MODEL_OVERLAYS, *OPTIMIZER_OVERLAYS, *BOUNDS_OVERLAYS}
CONFIGS = sorted(set(CONFIG_DIR.rglob("*.yaml")) - NOT_WHOLE)
QUICKSTART = CONFIG_DIR / "quickstart.yaml"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path" in capsys.readouterr().out


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[c.name for c in OVERLAYS])
def test_cluster_overlays_combine_with_a_task_config(overlay: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(QUICKSTART), "--config", str(overlay), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "dplightning.DPDDPStrategy" in printed and "num_nodes: 2" in printed


@pytest.mark.parametrize("overlay", list(MODEL_OVERLAYS), ids=[c.name for c in MODEL_OVERLAYS])
def test_model_overlays_combine_with_their_task_config(overlay: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(MODEL_OVERLAYS[overlay]), "--config", str(overlay), "--print_config"])
    assert exit_info.value.code == 0
    assert "lora:" in capsys.readouterr().out


@pytest.mark.parametrize("overlay", BOUNDS_OVERLAYS, ids=[c.name for c in BOUNDS_OVERLAYS])
def test_bounds_overlays_set_only_the_networks_bounds(overlay: Path) -> None:
    bounds = yaml.safe_load(overlay.read_text())["model"]["init_args"]["model"]["init_args"]
    assert set(bounds) == {"c_max", "gamma_max", "beta_max", "alpha_max"}
    net = build_cli(["--config", str(AWARE_ARM), "--config", str(overlay)], run=False).model.model
    block = net.blocks[0].bounds
    assert (net.c_max, block.gamma_max, block.beta_max, block.alpha_max) == tuple(bounds.values())


@pytest.mark.parametrize("overlay", list(OPTIMIZER_OVERLAYS), ids=[c.name for c in OPTIMIZER_OVERLAYS])
def test_optimizer_overlays_switch_only_the_optimizer(overlay: Path, capsys: pytest.CaptureFixture[str]) -> None:
    content = yaml.safe_load(overlay.read_text())
    assert list(content) == ["model"] and list(content["model"]) == ["init_args"]
    assert list(content["model"]["init_args"]) == ["optimizer"]
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(OPTIMIZER_OVERLAYS[overlay]), "--config", str(overlay), "--print_config"])
    assert exit_info.value.code == 0
    assert f"class_path: {content['model']['init_args']['optimizer']['class_path']}" in capsys.readouterr().out


@pytest.mark.e2e
def test_quickstart_runs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", "--config", str(QUICKSTART)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, dplightning.DPStrategy)
    assert strategy.dp_state.steps == 40 * 5  # 40 epochs of ceil(1258 / 256) Poisson steps
    assert strategy.get_epsilon() <= 3.0
    assert cli.trainer.callback_metrics["test_acc"] > 0.5  # chance is 0.1


def test_a_fit_hides_lightnings_leafspec_deprecation_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.chdir(tmp_path)
    build_cli(["fit", "--config", str(QUICKSTART), "--trainer.max_steps=2", "--test_after_fit=false"])
    assert not [w for w in recwarn if "LeafSpec" in str(w.message)]
    # Targeted: the same message from another module still shows.
    message = "`isinstance(treespec, LeafSpec)` is deprecated, use something else"
    with pytest.warns(FutureWarning, match="LeafSpec"):
        warnings.warn_explicit(message, FutureWarning, "elsewhere.py", 1, module="elsewhere")


@pytest.mark.filterwarnings(r"error:strategy\.\w+ is deprecated:DeprecationWarning")  # no alias read by the library
def test_strategy_by_registered_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "fit",
            "--config",
            str(QUICKSTART),
            "--trainer.strategy",
            "dp",
            "--trainer.max_epochs",
            "1",
            "--test_after_fit",
            "false",
        ]
    )
    assert isinstance(cli.trainer.strategy, dplightning.DPStrategy) and cli.trainer.strategy.dp_state.steps == 5


@pytest.mark.e2e
def test_validate_test_and_predict_subcommands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fit = build_cli(["fit", "--config", str(QUICKSTART), "--trainer.max_epochs", "1", "--test_after_fit", "false",
                     "--trainer.enable_checkpointing", "true"])  # fmt: skip
    ckpt = fit.trainer.checkpoint_callback.best_model_path
    common = ["--config", str(QUICKSTART), "--ckpt_path", ckpt]
    for subcommand in ("validate", "test"):
        cli = build_cli([subcommand, *common])
        assert cli.trainer.callback_metrics  # val_acc / test_acc
    predictions = build_cli(["predict", *common, "--return_predictions", "true"]).trainer.predict_loop.predictions
    assert sum(len(p) for p in predictions) == 359


@pytest.mark.parametrize("strategy", ["dplightning.DPStrategy", "dplightning.DPDDPStrategy"])
def test_strategy_help_lists_every_dp_argument_with_its_doc(strategy: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import fields

    from dplightning.strategies.config import _DOCS, DPConfig

    with pytest.raises(SystemExit):
        build_cli(["fit", "--trainer.strategy.help", strategy])
    printed = " ".join(capsys.readouterr().out.split())  # help text is wrapped
    names = [f.name for f in fields(DPConfig) if not (f.name == "noise_placement" and strategy.endswith(".DPStrategy"))]
    for name in names:
        assert f"--trainer.strategy.{name}" in printed, name
        assert " ".join(_DOCS[name].split()[:4]) in printed, name


def test_export_and_memory_plan_are_commands_of_their_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dplightning.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "export --ckpt" in capsys.readouterr().out
    with pytest.raises(SystemExit) as plan:
        config = str(CONFIG_DIR / "finetune" / "e2e_opt_small_cpu.yaml")
        main(["memory-plan", "--config", config, "--gpu-memory", "8GB"])
    assert plan.value.code == 0 and "estimated peak" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError):
        main(["export", "--ckpt", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "out")])
