"""The front door stays honest: every relative link in README.md and docs/*.md resolves (the file,
and a ``#anchor`` to a heading of a Markdown file, slugged as GitHub does), and every command in
the README's ``bash`` blocks is accepted by its entry point's parser from an empty folder (what a
pip install has: recipes by name), nothing trained or read."""
from __future__ import annotations

import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
#: the README's promise
MAX_README_LINES = 180

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, each
    space a ``-`` (so ``Time slices: `--time-budget``` is ``time-slices---time-budget``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, outside code blocks (a repeated heading's ``-1``, ``-2``...
    included)."""
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            count = seen.get(base, 0)
            seen[base] = count + 1
            seen.setdefault(f"{base}-{count}" if count else base, 1)
    return set(seen)


def relative_links(page: Path) -> list[str]:
    """The page's link targets that are neither a URL nor a mail address, outside code blocks."""
    return [t for t in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"[a-z][a-z+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path) if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


#: first words of the README's tooling lines, which are not the package's commands
TOOLING = ("make", ".venv/bin/python", "pip")


def readme_lines() -> list[list[str]]:
    """Each command line of the README's ``bash`` blocks as words: continuation lines joined,
    comments dropped."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(words)
    return lines


def readme_commands() -> list[list[str]]:
    """The README's lines that run one of the package's commands (``make`` targets and the
    virtual environment's pytest are left to the Makefile and the test suite)."""
    return [words for words in readme_lines() if words[0] not in TOOLING]


class Parsed(Exception):
    """Raised where the training CLI would start building the run: the arguments parsed."""


def parse_fit_cli(args: list[str]) -> None:
    """``graphormer-urpe SUBCOMMAND ...`` through LightningCLI's parser (configs, overrides and
    their types), stopped before anything is instantiated, checked or written; a refused
    argument is LightningCLI's SystemExit."""
    from graphormer_urpe.training.lightning_cli import GraphormerCLI, build_cli

    if args[:1] == ["recipes"] or "--print_config" in args:  # printed once parsed: exit status 0
        with pytest.raises(SystemExit) as printed:
            build_cli(args)
        assert printed.value.code == 0
        return

    def stop(cli):
        raise Parsed(cli.config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GraphormerCLI, "before_instantiate_classes", stop)
        patch.setattr(sys, "argv", ["graphormer-urpe"])  # the arguments are args alone
        with pytest.raises(Parsed):
            build_cli(args)


def parse_with_overrides(parse, configs_of):
    """An argparse command whose other arguments are ``fit`` overrides (ablation, hpopt): its own
    parser, then the overrides on its config files through :func:`parse_fit_cli`."""
    def check(args: list[str]) -> None:
        own, overrides = parse(args)
        parse_fit_cli(["fit", *[w for c in configs_of(own) for w in ("--config", c)], *overrides])
    return check


def parsers() -> dict:
    from graphormer_urpe.cli import ablation
    from graphormer_urpe.cli import explain
    from graphormer_urpe.cli import hpopt
    from graphormer_urpe.cli import predict
    from graphormer_urpe.cli import submit
    from graphormer_urpe.cli import synthetic

    return {
        "graphormer-urpe": parse_fit_cli,
        "graphormer-urpe-predict": lambda args: predict.build_parser().parse_args(args),
        "graphormer-urpe-explain": lambda args: explain.build_parser().parse_args(args),
        "graphormer-urpe-submit": submit.parse_args,
        "graphormer-urpe-synthetic": lambda args: synthetic._parser().parse_args(args),
        "graphormer-urpe-ablation": parse_with_overrides(ablation.parse_args, lambda own: own.config),
        "graphormer-urpe-hpopt": parse_with_overrides(hpopt.parse_args, lambda own: own.config),
    }


def test_the_readme_commands_are_entry_points_of_the_package():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    commands = {words[0] for words in readme_commands()}
    assert commands and commands <= set(scripts)
    assert commands <= set(parsers()), "give the new command's parser to parsers()"
    assert ["make", "quickstart"] in readme_lines() and ["make", "test"] in readme_lines()


@pytest.mark.parametrize("words", [
    ["graphormer-urpe", "fit", "--config", "configs/zinc.yaml", "--model.no_such_key", "1"],
    ["graphormer-urpe", "fit", "--config", "configs/no_such_recipe.yaml"],
    ["graphormer-urpe-predict", "--ckpt", "a.ckpt", "--input", "in.csv"],  # no --output
    ["graphormer-urpe-ablation", "--config", "configs/zinc.yaml", "--model.lr", "fast"],
], ids=["unknown key", "missing config", "missing option", "override of the wrong type"])
def test_a_wrong_command_is_refused_by_the_check(words, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        parsers()[words[0]](words[1:])


@pytest.mark.parametrize("words", readme_commands(), ids=lambda words: " ".join(words)[:70])
def test_each_readme_command_parses(words, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing of the checkout: recipes by name
    parsers()[words[0]](words[1:])


#: the libraries that take seconds to import on a 2-core CPU (Lightning alone 5.6 s)
HEAVY_IMPORTS = {"torch", "lightning", "matplotlib", "optuna", "rdkit", "torch_geometric", "pandas"}


@pytest.mark.parametrize("words", [
    ["graphormer-urpe", "recipes"], ["graphormer-urpe", "recipes", "zinc"], ["graphormer-urpe-plot", "--help"],
    ["graphormer-urpe-plot", "curves", "--help"], ["graphormer-urpe-hpopt", "--help"],
    ["graphormer-urpe-export", "--help"], ["graphormer-urpe-submit", "--help"],
], ids=" ".join)
def test_help_imports_no_heavy_library(words, tmp_path):
    """What the installed command imports to answer (``python -X importtime``): none of
    :data:`HEAVY_IMPORTS` (scripts/bench_help.py times every command's --help)."""
    import subprocess

    done = subprocess.run([sys.executable, "-X", "importtime", str(Path(sys.executable).with_name(words[0])),
                           *words[1:]], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and done.stdout, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert not imported & HEAVY_IMPORTS


def _imported(stderr: str) -> set[str]:
    """The top-level packages in ``python -X importtime``'s report."""
    return {line.split("|")[-1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:")}


def test_the_training_help_is_kept_and_follows_what_it_depends_on(tmp_path):
    """``graphormer-urpe fit --help`` writes LightningCLI's help (Lightning imported) and keeps it
    in the user's cache folder: the same help again is the same text without any heavy import; at
    another terminal width the help is written anew at that width, not read back."""
    import os
    import subprocess

    command = [sys.executable, "-X", "importtime", str(Path(sys.executable).with_name("graphormer-urpe")),
               "fit", "--config", "csv", "--help"]

    def helped(columns: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": str(columns)}
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        assert done.returncode == 0 and done.stdout.startswith("usage: graphormer-urpe"), done.stderr[-2000:]
        return done

    first, again = helped(100), helped(100)
    assert "lightning" in _imported(first.stderr) and "--trainer.max_epochs" in first.stdout
    assert again.stdout == first.stdout
    assert not _imported(again.stderr) & HEAVY_IMPORTS
    narrow = helped(60)
    assert "lightning" in _imported(narrow.stderr)
    assert len(narrow.stdout.splitlines()) > len(first.stdout.splitlines())  # wrapped narrower


def test_a_help_that_fails_is_not_kept(tmp_path):
    """An unknown option beside ``--help`` is LightningCLI's error (exit status 2), each time."""
    import os
    import subprocess

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for _ in range(2):
        done = subprocess.run([str(Path(sys.executable).with_name("graphormer-urpe")), "fit", "--config",
                               "no-such-recipe", "--help"], capture_output=True, text=True, cwd=tmp_path,
                              env=env, timeout=300)
        assert done.returncode == 2 and "no-such-recipe" in done.stderr
    assert not list((tmp_path / "cache").rglob("*.txt"))


def test_a_kept_help_follows_an_edit_of_its_config_file(tmp_path):
    """``fit --config FILE --help``: kept after the first run, written anew once FILE changes."""
    import os
    import subprocess

    config = tmp_path / "mine.yaml"
    config.write_text("trainer:\n  max_epochs: 3\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    command = [sys.executable, "-X", "importtime", str(Path(sys.executable).with_name("graphormer-urpe")),
               "fit", "--config", str(config), "--help"]

    def imported_lightning() -> bool:
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        assert done.returncode == 0 and done.stdout.startswith("usage: graphormer-urpe"), done.stderr[-2000:]
        return "lightning" in _imported(done.stderr)

    assert imported_lightning() and not imported_lightning()
    config.write_text("trainer:\n  max_epochs: 30\n")
    assert imported_lightning()
