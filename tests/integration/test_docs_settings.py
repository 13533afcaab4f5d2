"""Settings the docs' commands rely on: what a newcomer runs gives what the pages show.

* the DP-aware AdaLN configs sample as the benchmark behind the doc's tables did (the x̂₀ clamp);
* ``predict`` on a causal-LM config writes the generated texts to a file;
* a ``last.ckpt`` a page names is one its config writes;
* ``pip install`` lines install from the clone (dplightning is not on a package index);
* benchmarks and examples write into the committed records only when told to.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
CONFIGS = ROOT / "configs"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _config(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def _argparse_default(script: Path, option: str) -> ast.expr | None:
    """The ``default=`` expression of ``add_argument(option, ...)`` in a script, unevaluated."""
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if option in names:
                return next((k.value for k in node.keywords if k.arg == "default"), None)
    raise AssertionError(f"{script.name} has no {option} option")


TIMESERIES = sorted(set((CONFIGS / "timeseries").glob("*.yaml")) - set((CONFIGS / "timeseries").glob("bounds_*.yaml")))


@pytest.mark.parametrize("config", TIMESERIES, ids=[c.name for c in TIMESERIES])
def test_timeseries_configs_sample_as_the_docs_tables(config: Path) -> None:
    benchmark_clamp = ast.literal_eval(_argparse_default(ROOT / "benchmarks" / "dp_aware_adaln.py", "--clip-denoised"))
    assert _config(config)["model"]["init_args"].get("clip_denoised") == benchmark_clamp


CAUSAL_LM = [p for p in sorted(CONFIGS.rglob("*.yaml")) if "dplightning.tasks.DPCausalLM" in p.read_text()]


@pytest.mark.parametrize("config", CAUSAL_LM, ids=[c.name for c in CAUSAL_LM])
def test_causal_lm_configs_write_their_predictions(config: Path) -> None:
    callbacks = _config(config)["trainer"].get("callbacks") or []
    assert "dplightning.data.TextPredictionWriter" in [c["class_path"] for c in callbacks]


def _named_last_checkpoints() -> set[str]:
    found = set()
    for page in PAGES:
        found |= set(re.findall(r"lightning_logs/[\w.\-/]+/checkpoints/last\.ckpt", page.read_text(encoding="utf-8")))
    return found


def test_every_last_ckpt_a_page_names_is_written_by_a_config() -> None:
    named = _named_last_checkpoints()
    assert named
    written = set()
    for path in CONFIGS.rglob("*.yaml"):
        trainer = _config(path).get("trainer") or {}
        saves_last = any(
            c["class_path"].endswith("ModelCheckpoint") and (c.get("init_args") or {}).get("save_last")
            for c in trainer.get("callbacks") or []
        )
        if saves_last and trainer.get("logger") is False and trainer.get("enable_checkpointing") is not False:
            written.add(f"{trainer['default_root_dir']}/checkpoints/last.ckpt")
    assert named <= written, f"named but never written: {sorted(named - written)}"


def test_pip_install_lines_install_from_the_clone() -> None:
    texts = [p.read_text(encoding="utf-8") for p in PAGES] + [p.read_text() for p in CONFIGS.rglob("*.yaml")]
    installs = [m for text in texts for m in re.findall(r"pip install [^`\n#]*", text)]
    assert installs
    for line in installs:
        from_clone = re.search(r"pip install (-e )?['\"]?(\.|\S*/dplightning)(\[|['\"\s]|$)", line)
        assert from_clone, f"not from a clone: {line!r}"


OUTPUT_OPTIONS = ("--out", "--figures", "--figure")


def _output_defaults() -> list[tuple[str, str, str]]:
    found = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "examples").glob("*.py")):
        for option in OUTPUT_OPTIONS:
            try:
                default = _argparse_default(script, option)
            except AssertionError:
                continue
            found.append((script.name, option, ast.unparse(default) if default is not None else "None"))
    return found


def test_benchmarks_and_examples_write_outside_the_committed_records_by_default() -> None:
    defaults = _output_defaults()
    assert len(defaults) >= 10
    for script, option, default in defaults:
        assert default == "None" or re.fullmatch(r"(str\()?default_(result|figures)\(.*\)\)?", default), (
            f"{script} {option} defaults to {default}: write under outputs/ (benchmarks/_outputs.py)"
        )
    for script in (ROOT / "benchmarks").glob("*.py"):  # nor a fixed path into the records, outside the options
        for node in ast.parse(script.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign):
                value = ast.unparse(node.value)
                assert "'results'" not in value and "docs/figures" not in value, f"{script.name}: {value}"
