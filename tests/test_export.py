"""``dplightning export``: privacy.json and the model card state the unit, the test seed and what DP does not cover."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dplightning.commands.export import load_module
from dplightning.commands.export import main as export_main
from dplightning.data import TextFileDataModule
from dplightning.strategies._dp import CHECKPOINT_KEY
from dplightning.tasks import CLASS_KEY, CONFIG_KEY, DPCausalLM
from tests.helpers import dp, make_trainer
from tests.tasks import hf_tiny

WORDS = "the cheap pub near the river serves italian food with a view of the city centre".split()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A seeded 2-step tiny GPT-2 run whose BPE was fitted on its private training file, exported."""
    root = tmp_path_factory.mktemp("export")
    (root / "train.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(WORDS[i % 7 : i % 7 + 5])}) + "\n" for i in range(48))
    )
    data = TextFileDataModule(str(root / "train.jsonl"), vocab_size=280, tokenizer_dir=str(root / "tok"),
                              batch_size=8, max_length=32)  # fmt: skip
    torch.manual_seed(0)
    module = DPCausalLM(config={**hf_tiny.config("gpt2"), "vocab_size": 280, "bos_token_id": 1, "eos_token_id": 1})
    with pytest.warns(UserWarning, match="seed= is FOR TESTS ONLY"):
        trainer = make_trainer(dp(noise_multiplier=1.0, seed=0), max_steps=2, limit_val_batches=0)
        trainer.fit(module, data)
    trainer.save_checkpoint(root / "run.ckpt")
    assert export_main(["--ckpt", str(root / "run.ckpt"), "--out", str(root / "out")]) == 0
    return root / "run.ckpt", root / "out" / "model"


def test_privacy_json_carries_the_seed_the_unit_and_the_private_tokenizer(exported: tuple[Path, Path]) -> None:
    _, folder = exported
    privacy = json.loads((folder / "privacy.json").read_text())
    assert privacy["seeded"] is True and privacy["secure_mode"] is False
    assert privacy["privacy_unit"] == "one row of the training file"
    assert privacy["privacy_unit_record"] == {"description": "one row of the training file", "window": None,
                                              "stride": None, "rows_per_unit": 1}  # fmt: skip
    assert "fitted on the private training split" in privacy["not_covered"]["tokenizer"]


def test_the_model_card_warns_of_the_seed_and_names_the_private_tokenizer(exported: tuple[Path, Path]) -> None:
    _, folder = exported
    card = (folder / "README.md").read_text()
    assert "**WARNING: a test seed (seed=) fixed the noise and the Poisson sampling, so the (ε, δ) guarantee does " \
        "not hold against anyone who knows the seed. Do not release this model as private.**" in card  # fmt: skip
    assert "- Privacy unit: one row of the training file." in card
    assert "computed from the private training data outside the DP steps: tokenizer, a byte-level BPE vocabulary " \
        "fitted on the private training split." in card  # fmt: skip


def test_export_refuses_a_ledger_that_contradicts_the_checkpoint(
    exported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _ = exported
    checkpoint = torch.load(ckpt, weights_only=False)
    sigma, q, _ = checkpoint[CHECKPOINT_KEY]["ledger"]["history"][-1]
    checkpoint[CHECKPOINT_KEY]["ledger"]["history"] = [[sigma, q, 1]]  # one step charged for two updates
    torch.save(checkpoint, tmp_path / "tampered.ckpt")
    assert export_main(["--ckpt", str(tmp_path / "tampered.ckpt"), "--out", str(tmp_path / "out")]) == 3
    assert "the ledger charges 1 steps but the checkpoint's global_step is 2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_naming_the_module_s_old_class_path_still_exports(
    exported: tuple[Path, Path], tmp_path: Path
) -> None:
    """Checkpoints saved before ``modules/`` became ``tasks/`` (issue 26) store the old dotted path of their class."""
    ckpt, _ = exported
    checkpoint = torch.load(ckpt, weights_only=False)
    assert checkpoint[CLASS_KEY] == "dplightning.tasks.causal_lm.DPCausalLM"
    checkpoint[CLASS_KEY] = "dplightning.modules.causal_lm.DPCausalLM"
    torch.save(checkpoint, tmp_path / "old.ckpt")
    assert type(load_module(checkpoint)) is DPCausalLM
    assert export_main(["--ckpt", str(tmp_path / "old.ckpt"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model" / "privacy.json").exists()


@pytest.mark.parametrize("key", ["config", "class"])
def test_export_never_runs_code_a_checkpoint_names(
    exported: tuple[Path, Path], tmp_path: Path, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint that loads with weights_only=True is still data: no class path in it is imported or called."""
    ckpt, _ = exported
    checkpoint = torch.load(ckpt, weights_only=False)
    marker = tmp_path / "ran"
    if key == "config":
        checkpoint[CONFIG_KEY] = {"class_path": "subprocess.run", "init_args": {"args": ["touch", str(marker)]}}
    else:
        checkpoint[CLASS_KEY] = "subprocess.Popen"
    torch.save(checkpoint, tmp_path / "hostile.ckpt")
    assert export_main(["--ckpt", str(tmp_path / "hostile.ckpt"), "--out", str(tmp_path / "out")]) == 2
    assert not marker.exists()
    refusal = "is not a transformers config class" if key == "config" else "is not a dplightning task class"
    assert refusal in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_config_class_path_builds_transformers_configs_only() -> None:
    from dplightning.models.hf import build_config

    built = build_config({"class_path": "transformers.GPT2Config", "init_args": {"n_layer": 1}})
    assert type(built).__name__ == "GPT2Config" and built.n_layer == 1
    for path in ("subprocess.run", "builtins.eval", "transformers.AutoModel", "transformers.utils.logging"):
        with pytest.raises(ValueError, match="config class_path"):
            build_config({"class_path": path, "init_args": {}})
