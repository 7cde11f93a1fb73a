"""`stopline bench`'s inputs are checked before anything is measured: a usage error
(exit 2) or a typed failure (exit 1) naming the input, and no figure printed.

Each of these ran before: a soak of ``--minutes -1`` ran for no time and passed, a
``--json`` path in no directory failed after the table, an unreachable ``--postgres``
failed with psycopg's traceback a minute in, and ``--crash`` without ``--soak`` was
ignored."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stopline.bench import options, soak
from stopline.cli import main
from stopline.errors import InvalidInput, LedgerUnavailable

NOWHERE = "postgresql://nobody@127.0.0.1:1/none"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--soak", "--minutes", "-1"], "invalid --minutes: -1: must be more than 0"),
        (["--soak", "--minutes", "0"], "invalid --minutes: 0: must be more than 0"),
        (["--soak", "--minutes", "nan"], "invalid --minutes: nan"),
        (["--crash"], "--crash and --minutes go with --soak"),
        (["--minutes", "3"], "--crash and --minutes go with --soak"),
        (["--soak", "--quick"], "--soak takes --minutes, --crash and --postgres"),
        (["--soak", "--json", "x.json"], "--soak takes --minutes, --crash and --postgres"),
        (["--quick", "--json", "{tmp}/no/such/dir/f.json"], "no directory {tmp}/no/such/dir"),
        (["--quick", "--json", "{tmp}"], "{tmp} is a directory"),
    ],
)
def test_a_bad_option_is_a_usage_error_before_anything_is_measured(
    args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["bench", *args]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("stopline: usage: ") and says.format(tmp=tmp_path) in err
    assert "figure" not in out and "violations" not in out


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--quick", "--postgres", NOWHERE], 1, f"error: ledger {NOWHERE}: connection failed"),
        (["--soak", "--postgres", NOWHERE], 1, f"error: ledger {NOWHERE}: connection failed"),
        (["--quick", "--postgres", f"{NOWHERE}?turbo=1"], 1, "error: ledger"),
        (["--quick", "--postgres", "nonsense"], 2, "usage: invalid --postgres: nonsense is not"),
        (
            ["--quick", "--postgres", f"{NOWHERE}?schema=mine"],
            2,
            "usage: invalid --postgres: ",
        ),
    ],
)
def test_a_server_the_bench_cannot_use_is_refused_before_anything_is_measured(
    args: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that cannot be reached, or a URL libpq refuses, is exit 1 as a bad
    ``--ledger`` is; a URL that is not one the bench can take, a usage error."""
    assert main(["bench", *args]) == code
    out, err = capsys.readouterr()
    assert err.startswith(f"stopline: {says}")
    assert "Traceback" not in err
    assert "figure" not in out and "violations" not in out


def test_the_checks_hold_for_a_caller_of_the_modules_too(tmp_path: Path) -> None:
    """``stopline.bench.main`` and ``soak.main`` check the same inputs themselves."""
    from stopline import bench

    with pytest.raises(InvalidInput, match=re.escape("invalid --json")):
        bench.main(quick=True, json_path=str(tmp_path / "no" / "f.json"))
    with pytest.raises(InvalidInput, match="invalid rounds: 0"):
        bench.main(quick=True, rounds=0)
    with pytest.raises(InvalidInput, match="invalid --minutes"):
        soak.main(seconds=0)
    with pytest.raises(LedgerUnavailable, match="connection failed"):
        soak.main(seconds=1, postgres=NOWHERE)


def test_a_json_path_that_can_be_written_is_taken(tmp_path: Path) -> None:
    assert options.check_json_path(str(tmp_path / "new.json")) == tmp_path / "new.json"
    (tmp_path / "old.json").write_text("{}")
    assert options.check_json_path(str(tmp_path / "old.json")) == tmp_path / "old.json"
    assert options.check_minutes(0.5) == 0.5
