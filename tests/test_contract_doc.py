"""docs/contract.md is the specification inside the repository: every
scenario it lists has a test named for it, and every rule is cited by the
tests that check it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = (ROOT / "docs" / "contract.md").read_text()
TESTS = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))


def test_every_scenario_has_a_test_named_for_it() -> None:
    scenarios = sorted({int(n) for n in re.findall(r"^\| S(\d+) \|", CONTRACT, re.M)})
    assert scenarios == list(range(1, 18))
    names = set(re.findall(r"def test_s(\d+)_", TESTS))
    missing = [f"S{n}" for n in scenarios if f"{n:02d}" not in names and str(n) not in names]
    assert missing == []


def test_every_rule_is_cited_by_a_test() -> None:
    rules = sorted({int(n) for n in re.findall(r"^- \*\*R(\d+) ", CONTRACT, re.M)})
    assert rules == list(range(1, 15))
    cited = {int(n) for n in re.findall(r"\bR(\d+)\b", TESTS)}
    missing = [f"R{n}" for n in rules if n not in cited]
    assert missing == []
