"""The search space of ``graphormer-urpe-hpopt`` (a YAML mapping of ``fit`` keys to ranges, such
as ``model.lr: {type: float, low: 1e-5, high: 1e-3, log: true}``) and its recipe, both checked
before any trial (with :func:`.study.parse_fit`); a refusal names the file, the line and the key.
"""
from __future__ import annotations

import functools
import json
import math
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from graphormer_urpe.training.studies.study import Refused, objective, parse_fit, recipe_args

#: Keys the search sets itself in every trial.
OWN_KEYS = ("trainer.default_root_dir", "ckpt_path")
KINDS = ("float", "int", "categorical")
#: A trial's values, as a config file in its run directory (after the recipe's).
PARAMS_CONFIG = "params.yaml"


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: ``1e-5`` is a number (PyYAML's YAML 1.1 reads it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.inf|\.Inf|\.INF|\.nan|\.NaN|\.NAN)$"),
    list("-+0123456789."))


@dataclass(frozen=True)
class Param:
    """One key's range: ``float`` / ``int`` from ``low`` to ``high`` (``log`` or ``step``), or ``choices``."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple | None = None
    #: Where the key is written (``--space FILE, line N: KEY``), to name it in a refusal; not
    #: part of the recipe a study records.
    where: str = field(default="", compare=False, repr=False)

    def suggest(self, trial) -> Any:
        """This key's value in an Optuna trial."""
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_categorical(self.key, self.choices) if self.type == "categorical" else \
            trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def probes(self) -> list:
        """The values whose config must parse: both ends, or every choice."""
        return list(self.choices) if self.type == "categorical" else [self.low, self.high]

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if k not in ("key", "where") and v not in (None, False)}


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _number(where: str, name: str, value: Any, integer: bool) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise Refused(f"{where}: {name} must be a finite number, got {value!r}")
    if integer and value != int(value):
        raise Refused(f"{where}: {name} must be an integer for type int, got {value!r}")
    return int(value) if integer else float(value)


def parse_param(key: str, spec: Any, where: str = "") -> Param:
    """One entry of the search space, checked (:class:`Refused` starting with ``where``)."""
    where = where or f"search space {key}"

    def check(ok: Any, problem: str) -> None:
        if not ok:
            raise Refused(f"{where}: {problem}")

    check(isinstance(spec, dict), f"expected a mapping such as {{type: float, low: 1e-5, high: 1e-3}}, got {spec!r}")
    kind = spec.get("type")
    check(kind in KINDS, f"type must be one of {list(KINDS)}, got {kind!r}")
    allowed = {"type", "choices"} if kind == "categorical" else {"type", "low", "high", "log", "step"}
    unknown = sorted(map(str, set(spec) - allowed))
    check(not unknown, f"unknown field(s) {unknown} for type {kind} (allowed: {sorted(allowed)})")
    if kind == "categorical":
        choices = spec.get("choices")
        check(isinstance(choices, list) and choices, f"choices must be a non-empty list, got {choices!r}")
        bad = [c for c in choices if c is not None and not (isinstance(c, (bool, int, float, str)) and _finite(c))]
        check(not bad, f"choices must be finite numbers, strings, booleans or null, got {(bad or [None])[0]!r}")
        check(len({json.dumps(c) for c in choices}) == len(choices), f"choices repeat a value: {choices!r}")
        return Param(key, kind, choices=tuple(choices), where=where)
    check("low" in spec and "high" in spec, f"type {kind} needs low and high")
    low, high = (_number(where, name, spec[name], kind == "int") for name in ("low", "high"))
    log, step = spec.get("log", False), spec.get("step")
    check(isinstance(log, bool), f"log must be true or false, got {log!r}")
    step = None if step is None else _number(where, "step", step, kind == "int")
    check(step is None or step > 0, f"step must be > 0, got {step!r}")
    check(step is None or not log, "step and log cannot be combined")
    check(low < high, f"low must be below high, got low={low!r}, high={high!r}")
    check(not log or low > 0, f"a log range needs low > 0, got low={low!r}")
    return Param(key, kind, low, high, log, step, where=where)


def _refuse_repeated_keys(path: Path, node: yaml.Node, parent: str | None = None) -> None:
    """A key written twice in one mapping (YAML would keep the last) refused, with both lines."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(path, item, parent)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        line, key = key_node.start_mark.line + 1, key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        if key is not None and key in seen:
            raise Refused(f"--space {path}, line {line}: {f'{parent}: field {key!r}' if parent else key} is "
                          f"written twice (first on line {seen[key]}; YAML would keep only the last): write it once")
        seen.setdefault(key, line)
        _refuse_repeated_keys(path, value_node, parent or key)


def read_space(path: Path) -> dict[str, Param]:
    """The search space file: dotted ``fit`` keys to ranges."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise Refused(f"--space {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise Refused(f"--space {path}: not a text file") from None
    try:
        root = yaml.compose(text, Loader=_Loader)
        space = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise Refused(f"--space {path}: not YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(space, dict) or not space:
        raise Refused(f"--space {path}: expected a non-empty mapping of fit keys to ranges, e.g. "
                      "'model.lr: {type: float, low: 1e-5, high: 1e-3, log: true}'")
    _refuse_repeated_keys(path, root)
    lines = {node.value: node.start_mark.line + 1 for node, _ in root.value if isinstance(node, yaml.ScalarNode)}
    params = {}
    for key, spec in space.items():
        line = lines.get(str(key))
        where = f"--space {path}{f', line {line}' if line else ''}: {key}"
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            raise Refused(f"{where}: not a dotted fit key such as model.lr")
        if key.removeprefix("fit.") in OWN_KEYS:
            raise Refused(f"{where}: the search sets it for every trial")
        params[key] = parse_param(key, spec, where)
    return params


def nested(values: dict[str, Any]) -> dict:
    """``{"model.backbone.dropout": 0.1}`` -> ``{"model": {"backbone": {"dropout": 0.1}}}``."""
    tree: dict = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        functools.reduce(lambda node, part: node.setdefault(part, {}), parents, tree)[leaf] = value
    return tree


def config_text(values: dict[str, Any]) -> str:
    """A trial's values as a config file (PyYAML writes floats with a dot: every reader's number)."""
    return yaml.safe_dump(nested(values), sort_keys=False, default_flow_style=False)


def override_keys(overrides: list[str]) -> list[str]:
    """The keys the pass-through overrides set (``--key value`` / ``--key=value``)."""
    return [arg[2:].split("=", 1)[0] for arg in overrides if arg.startswith("--") and len(arg) > 2]


def check_overrides(overrides: list[str], space: dict[str, Param]) -> None:
    for key in override_keys(overrides):
        if key.removeprefix("fit.") in OWN_KEYS:
            raise Refused(f"--{key}: the search sets it for every trial (trials run in "
                          "<runs-dir>/<study>/trial-<n>)")
        if key in space:
            raise Refused(f"--{key} is both an override and a search space key: drop one")


def check_recipe(configs: list[str], overrides: list[str], space: dict[str, Param]) -> dict:
    """The recipe parses with both ends of every range and every choice (all keys at once; on a
    failure each alone names the culprit); the :func:`objective`."""
    recipe = recipe_args(configs, overrides)
    with tempfile.TemporaryDirectory(prefix="hpopt-check-") as scratch:
        probe = Path(scratch) / PARAMS_CONFIG

        def parse(values: dict):
            probe.write_text(config_text(values))
            return parse_fit([*recipe, "--config", str(probe)])

        probes = {key: param.probes() for key, param in space.items()}
        for i in range(max(map(len, probes.values()))):
            values = {key: values[i % len(values)] for key, values in probes.items()}
            try:
                config = parse(values)
            except Refused as together:
                try:
                    parse_fit(recipe)
                except Refused as exc:
                    raise Refused("the recipe (--config files and overrides) is not accepted by "
                                  f"graphormer-urpe fit: {exc}") from None
                for key, value in values.items():
                    try:
                        parse({key: value})
                    except Refused as exc:
                        raise Refused(f"{space[key].where}: {value!r} is not accepted by graphormer-urpe "
                                      f"fit: {exc}") from None
                raise Refused(f"search space values {values} are not accepted together by "
                              f"graphormer-urpe fit: {together}") from None
    return objective(config)


def recipe_record(configs: list[str], overrides: list[str], space: dict[str, Param]) -> dict:
    """What a study is tied to: the configs' contents, the overrides and the search space."""
    def text(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise Refused(f"--config {path}: {exc.strerror or exc}") from None

    return {"configs": [text(path) for path in configs], "overrides": list(overrides),
            "space": {key: param.as_dict() for key, param in space.items()}}
