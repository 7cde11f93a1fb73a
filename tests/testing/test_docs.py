"""docs/testing.md runs: every python block, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).parents[2] / "docs" / "testing.md"


def test_docs_testing_examples_run(capsys: object) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks
    namespace: dict[str, object] = {"__name__": "docs_testing"}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
