"""The optional extras (``plot``, ``hpopt``, ``fused``): whether one is installed, and the line saying how to install it."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re


def extra_of(module: str) -> tuple[str, str]:
    """``(extra, requirement)`` that brings ``module`` (``("plot", "matplotlib>=3.7")``) in the package's
    metadata; the test extra only where no other has it."""
    found = []
    for line in importlib.metadata.requires("graphormer-urpe") or []:
        requirement, _, marker = line.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([\w.-]+)["']""", marker)
        name = re.match(r"[A-Za-z0-9_.-]+", requirement.strip())
        if extra and name and name.group(0).replace("-", "_").lower() == module.lower():
            found.append((extra.group(1), requirement.strip()))
    found.sort(key=lambda pair: pair[0] == "test")
    if not found:
        raise LookupError(f"no extra of graphormer-urpe brings {module}")
    return found[0]


def missing_extra(module: str, needed_by: str) -> str | None:
    """Why ``needed_by`` cannot run here (``module`` is not installed, and how to install it), or None."""
    if importlib.util.find_spec(module) is not None:  # importable, not imported
        return None
    extra, requirement = extra_of(module)
    return (f"{needed_by} needs {module}, which is not installed: pip install '.[{extra}]' in the "
            f"source checkout, or pip install '{requirement}'")
