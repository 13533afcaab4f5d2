"""The shell commands of README.md and docs/*.md run as written, from the repository root.

Every command in a ``bash``/``sh`` code block, and every ``$ `` line of any code block, is
extracted and must match exactly one rule below: cheap commands run (training commands are
parsed with ``--print_config``, which checks the configs and every argument), long ones are
skipped by an explicit entry with its reason. A command no rule covers fails the test, so a
new command in the docs gets classified. Where a ``$ `` block shows the output, the output
printed now must equal it (minus the lines listed as machine-dependent).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dplightning.cli import main as cli_main
from tests.helpers import TinyModule, dp, loader, make_dataset, make_trainer

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
VOLATILE_OUTPUT = ("recorded versions", "installed now")  # the library versions of the machine that ran it


@dataclass(frozen=True)
class DocCommand:
    """One command of a page, with the output the page shows for it (``$`` blocks only)."""

    page: str
    line: int
    text: str
    shown_output: tuple[str, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _logical_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Join backslash continuations; drop blank and comment-only lines."""
    start, parts = 0, []
    for number, line in lines:
        if not parts:
            start = number
        stripped = line.strip()
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        joined = " ".join(p for p in parts if p)
        parts = []
        if joined and not joined.startswith("#"):
            yield start, joined


def _prompt_commands(page: str, lines: list[tuple[int, str]]) -> Iterator[DocCommand]:
    """``$ cmd`` lines of a block, each with the lines after it as the output shown."""
    prompts = [i for i, (_, line) in enumerate(lines) if line.startswith("$ ")]
    for k, i in enumerate(prompts):
        end = prompts[k + 1] if k + 1 < len(prompts) else len(lines)
        output = tuple(line for _, line in lines[i + 1 : end])
        yield DocCommand(page, lines[i][0], lines[i][1][2:].strip(), output)


def extract_commands(path: Path) -> list[DocCommand]:
    """The commands of one Markdown page."""
    page = str(path.relative_to(ROOT))
    found: list[DocCommand] = []
    block: list[tuple[int, str]] | None = None
    language = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            if block is None:
                block, language = [], line[3:].strip()
                continue
            if any(text.startswith("$ ") for _, text in block):
                found += _prompt_commands(page, block)
            elif language in SHELL_BLOCKS:
                found += [DocCommand(page, n, text) for n, text in _logical_lines(block)]
            block = None
        elif block is not None:
            block.append((number, line))
    return found


COMMANDS = [c for page in PAGES for c in extract_commands(page)]


# ----------------------------------------------------------------------------- how each command runs


def _split(command: str) -> tuple[dict[str, str], list[str]]:
    """Environment assignments and argv of a command, without its trailing comment."""
    argv = shlex.split(command, comments=True)
    env = {}
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        name, value = argv.pop(0).split("=", 1)
        env[name] = value
    return env, argv


def _without_repository_on_path(monkeypatch: pytest.MonkeyPatch, pythonpath: str | None) -> None:
    """Import as the installed console script would: the clone is on sys.path only with PYTHONPATH=."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    if pythonpath == ".":
        monkeypatch.syspath_prepend(str(ROOT))


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None), f"exit {exit_info.value.code}: {(out + err)[-3000:]}"
    return out


def parse_only(command: str, tmp_path: Path, monkeypatch, capsys) -> str:
    """``dplightning fit|predict ...``: the configs and every argument parse (``--print_config``)."""
    env, argv = _split(command)
    monkeypatch.chdir(ROOT)
    _without_repository_on_path(monkeypatch, env.get("PYTHONPATH"))
    if "--print_config" not in argv:
        argv.append("--print_config")
    printed = _run_cli(argv[1:], capsys)
    assert "class_path" in printed
    return printed


def run(command: str, tmp_path: Path, monkeypatch, capsys) -> str:
    """A cheap ``dplightning`` command, run as written from the repository root."""
    _, argv = _split(command)
    monkeypatch.chdir(ROOT)
    return _run_cli(argv[1:], capsys)


def run_on_tiny_checkpoint(command: str, tmp_path: Path, monkeypatch, capsys) -> str:
    """``privacy-report run.ckpt``: the 3-step run of tests/test_report.py, saved as ``run.ckpt``."""
    trainer = make_trainer(dp(noise_multiplier=1.3, accountant="rdp", max_grad_norm=0.7), max_steps=3)
    trainer.fit(TinyModule(), loader(make_dataset(64), 16))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    _, argv = _split(command)
    monkeypatch.chdir(tmp_path)
    return _run_cli(argv[1:], capsys)


Runner = Callable[[str, Path, pytest.MonkeyPatch, pytest.CaptureFixture[str]], str]
RUN: list[tuple[str, Runner]] = [
    (r"(PYTHONPATH=\. )?dplightning (fit|predict|validate|test) ", parse_only),
    (r"dplightning (memory-plan|calibrate) ", run),
    (r"dplightning configs\b", run),
    (r"dplightning privacy-report run\.ckpt$", run_on_tiny_checkpoint),
]
SKIP: list[tuple[str, str]] = [
    (r"make (demo|test)\b", "creates .venv and trains / runs the whole suite"),
    (r"(\.venv/bin/python -m )?pip install ", "installs packages"),
    (r"(OMP_NUM_THREADS=1 )?python benchmarks/", "a measurement of minutes to hours"),
    (r"python examples/", "a training run (about 30 s)"),
    (r"(torchrun|sbatch) ", "cluster launchers: tests/integration/test_launchers.py and test_cluster_overlay.py"),
    (r"dplightning export --ckpt lightning_logs/", "needs the checkpoint of the fit above it"),
    (r"python -m dplightning\.(metrics|evaluation)\.synthetic ", "needs the synthetic set of the predict above it"),
    (r"MALLOC_\S+ MALLOC_\S+ dplightning fit --config \.\.\.", "a placeholder for any config"),
    (
        r"python -m dplightning\.methods\.adaln_bounds (calibrate|vacuity) ",
        "a 600-step calibration, or the metrics.csv of a fit above it: tests/methods/test_adaln_bounds.py runs both",
    ),
]


def _rule(command: DocCommand) -> tuple[str, Runner | str]:
    matches = [(p, r) for p, r in RUN if re.match(p, command.text)]
    matches += [(p, reason) for p, reason in SKIP if re.match(p, command.text)]
    assert len(matches) == 1, f"{command.id}: {command.text!r} matches {len(matches)} rules; classify it here"
    return matches[0]


# ----------------------------------------------------------------------------- tests


def test_commands_are_found() -> None:
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "docs/multi_gpu_and_multi_node.md", "docs/trust.md"} <= pages
    assert any(c.shown_output for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_docs_command(command: DocCommand, tmp_path: Path, monkeypatch, capsys) -> None:
    pattern, action = _rule(command)
    if isinstance(action, str):
        pytest.skip(f"allow-listed ({action})")
    printed = action(command.text, tmp_path, monkeypatch, capsys)
    if command.shown_output:
        shown = [line for line in command.shown_output if not line.startswith(VOLATILE_OUTPUT)]
        now = [line for line in printed.splitlines() if not line.startswith(VOLATILE_OUTPUT)]
        assert now == shown, f"{command.id}: the page shows other output than the command prints now"
