"""The training recipes packaged with graphormer-urpe (``graphormer_urpe/recipes``; a source
checkout's ``configs/`` links there), taken by name or by path wherever ``--config`` is read: an
existing file wins, then a recipe of that name, anything else is refused in one line listing them.
A base recipe configures the data; an overlay sets a few keys on top of one and comes after it.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

#: The packaged recipes.
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
#: The options whose value is a config file (LightningCLI's ``--config`` and its short form).
CONFIG_OPTIONS = ("--config", "-c")
#: The subcommand that lists the recipes (``graphormer-urpe recipes [NAME]``).
LIST_COMMAND = "recipes"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def recipe_names() -> list[str]:
    """The packaged recipes' names, sorted."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def recipe_file(name: str) -> Path | None:
    """The packaged recipe called ``name`` (``zinc`` or ``zinc.yaml``), else None."""
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    path = RECIPES_DIR / f"{stem}.yaml"
    return path if _NAME.fullmatch(stem) and path.is_file() else None


def summary(path: Path) -> str:
    """A recipe's first line, its summary (without the ``#``)."""
    first = path.read_text(encoding="utf-8").split("\n", 1)[0]
    return first.lstrip("#").strip()


def _inline(value: str) -> bool:
    """Whether ``value`` is a config given as text (``'{"trainer": {...}}'``, ``'trainer: ...'``),
    which LightningCLI's ``--config`` also reads, rather than a file or a name."""
    return value.lstrip().startswith(("{", "---")) or "\n" in value or ": " in value


def resolve_config(value: str, option: str = "--config") -> str:
    """What ``--config value`` reads: ``value`` when it is a file (or a config given as text),
    else the packaged recipe of that name (a bare name that could mean both says which it read);
    ``ValueError`` (one line) when it is neither, or a file that is not a YAML mapping."""
    return _resolve(value, option)[0]


def _resolve(value: str, option: str) -> tuple[str, dict | None]:
    """:func:`resolve_config`'s file and the options it sets (None where LightningCLI reads it)."""
    if _inline(value):
        return value, None
    packaged = recipe_file(value)
    if os.path.isfile(value):
        options = _read_options(value, option, packaged)
        if packaged is not None and _is_bare(value):
            log.warning("%s %s: read the file %s here, not the packaged recipe %s (give that path "
                        "to read the recipe)", option, value, os.path.abspath(value), packaged)
        return value, options
    if packaged is not None:
        local = f"{value}.yaml"
        if _is_bare(value) and not value.endswith(".yaml") and os.path.isfile(local):
            log.warning("%s %s: read the packaged recipe %s, not the file %s here (give --config "
                        "./%s to read that file)", option, value, packaged, os.path.abspath(local), local)
        return str(packaged), _read_options(str(packaged), option)
    if os.path.exists(value):  # a directory, a pipe: LightningCLI says what is wrong with it
        return value, None
    raise ValueError(f"{option} {value}: no such file, nor a recipe of that name (the recipes: "
                     f"{', '.join(recipe_names())}; `graphormer-urpe recipes` says what each is)")


def _is_bare(value: str) -> bool:
    """Whether ``value`` is a bare name (``esol.yaml``), which may mean a recipe, not a path."""
    return os.sep not in value and "/" not in value


def _read_options(path: str, option: str = "--config", packaged: Path | None = None) -> dict:
    """The options the config file ``path`` sets; ``ValueError`` (one line) for a file that is not
    a YAML mapping, which LightningCLI would answer with its whole usage."""
    try:
        with open(path, encoding="utf-8") as file:
            options = yaml.safe_load(file)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        options, reason = None, " ".join(str(exc).split())
    else:
        reason = ("it is empty" if options is None else "it reads as plain text" if isinstance(options, str)
                  else f"it is a {type(options).__name__}")
    if isinstance(options, dict):
        return options
    recipe = f"; the packaged recipe of that name is {packaged}" if packaged is not None else ""
    raise ValueError(f"{option} {path}: not a config file (a YAML mapping of options): {reason}{recipe}")


def resolve_config_args(args: list[str]) -> list[str]:
    """``args`` with each ``--config NAME`` of a packaged recipe replaced by its file;
    ``ValueError`` (one line) for a base config after an overlay, which it would override."""
    resolved = list(args)
    overlay = None  # the first overlay given so far, as given: "--config rpe"
    for i, arg in enumerate(resolved):
        if arg in CONFIG_OPTIONS and i + 1 < len(resolved):
            option, at, prefix = arg, i + 1, ""
        elif isinstance(arg, str) and arg.startswith("--config="):
            option, at, prefix = "--config", i, "--config="
        else:
            continue
        given = os.fspath(resolved[at])[len(prefix):]
        path, options = _resolve(given, option)
        resolved[at] = prefix + path
        if options is None:
            continue
        data = options.get("data")  # an overlay names no data module
        if not (isinstance(data, str) or (isinstance(data, dict) and "class_path" in data)):
            overlay = overlay or f"{option} {given}"
        elif overlay is not None:
            raise ValueError(f"{option} {given} configures the data, a base recipe, but comes after "
                             f"{overlay}, which sets keys on top of one: the base would override them; "
                             f"give the base first ({option} {given} {overlay})")
    return resolved


def listing() -> str:
    """One line per recipe (its name and summary), then how to use them."""
    names = recipe_names()
    width = max(map(len, names), default=0) + 2
    lines = [f"The recipes of graphormer-urpe ({RECIPES_DIR}):"]
    lines += [f"  {name:<{width}}{summary(RECIPES_DIR / f'{name}.yaml')}" for name in names]
    lines += ["Train with one by name, overlays after a base recipe: graphormer-urpe fit --config zinc "
              "--config rpe.",
              "A file works as well: graphormer-urpe recipes NAME > my.yaml prints one to copy and edit; "
              "fit --config NAME --print_config prints it resolved, every key included."]
    return "\n".join(lines)


def recipes_command(args: list[str], prog: str = "graphormer-urpe") -> int:
    """``graphormer-urpe recipes [NAME]``: the list, or one recipe's file as it is. Exit status 0,
    2 for an unknown name (one line)."""
    if args and args[0] not in ("-h", "--help"):
        packaged = recipe_file(args[0]) if len(args) == 1 else None
        if packaged is None:
            print(f"{prog} {LIST_COMMAND}: error: {' '.join(args)}: not a recipe (the recipes: "
                  f"{', '.join(recipe_names())})", file=sys.stderr)
            return 2
        text = packaged.read_text(encoding="utf-8")
    else:
        text = listing() + "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def command_line(args: list[str], prog: str = "graphormer-urpe") -> list[str]:
    """A training command's arguments with recipe names resolved; ``recipes [NAME]`` and an
    unknown name (one line, exit status 2) end in ``SystemExit``, as argparse does."""
    if args and args[0] == LIST_COMMAND:
        raise SystemExit(recipes_command(args[1:], prog))
    try:
        return resolve_config_args(args)
    except ValueError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
