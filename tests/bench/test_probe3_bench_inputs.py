"""`stopline bench --json PATH`: a path that cannot be written is refused before
anything is measured, whoever runs it.

The check asked ``os.access``, which answers for the caller's permissions only: as
root (a container's usual user) every path passes it, so a path on a filesystem
that takes no new file (``/proc``), or a name longer than the filesystem allows,
passed the check, the whole run was measured, and the write failed after the table
(exit 1, ``[Errno 2] No such file or directory``). A path that passes is left as it
was: no file made, an existing one unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stopline.bench import options
from stopline.cli import main
from stopline.errors import InvalidInput


@pytest.mark.parametrize(
    "path",
    ["/proc/stopline-bench.json", "{tmp}/" + "n" * 300 + ".json"],
    ids=["no-new-file-there", "name-too-long"],
)
def test_a_json_path_that_cannot_be_made_is_refused_at_once(
    path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = path.format(tmp=tmp_path)
    with pytest.raises(InvalidInput, match=r"invalid --json: .* cannot be written"):
        options.check_json_path(path)
    assert main(["bench", "--quick", "--json", path]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("stopline: usage: invalid --json: ")
    assert "figure" not in out  # nothing was measured


def test_a_json_path_that_passes_is_left_as_it_was(tmp_path: Path) -> None:
    new = tmp_path / "new.json"
    assert options.check_json_path(str(new)) == new
    assert not new.exists()  # the check made no file
    old = tmp_path / "old.json"
    old.write_text('{"kept": 1}\n')
    assert options.check_json_path(str(old)) == old
    assert old.read_text() == '{"kept": 1}\n'


# the old code found a missing engine at the engines suite, after the core, lifecycle,
# truth and MCP suites (40 s and more of a quick run): the timeout says it was not found
# first, and the output that nothing was measured
@pytest.mark.timeout(30)
@pytest.mark.parametrize("module", ["temporalio", "dbos"])
def test_a_missing_engine_is_named_before_anything_is_measured(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    assert main(["bench", "--quick"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("stopline: this needs the ")
    assert f"(module {module!r} is not installed)" in err
    assert "figure" not in out
