"""No module of the package or its scripts uses a name it never defines or imports: such a name
fails only when its line runs, which for GPU-only paths (a recorded CUDA graph) is never on a
CPU test machine."""
from pathlib import Path

import pytest
from pyflakes import api, messages, reporter

REPO = Path(__file__).resolve().parents[1]


class Collect(reporter.Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
            self.found.append(str(message))

    def unexpectedError(self, filename, msg) -> None:
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:
        self.found.append(f"{filename}:{lineno}: {msg}")


@pytest.mark.parametrize("folder", ["graphormer_urpe", "scripts"])
def test_every_name_used_is_defined(folder):
    collect = Collect()
    for path in sorted((REPO / folder).rglob("*.py")):
        api.checkPath(str(path), collect)
    assert collect.found == []
