"""The names the thirteenth Temporal probe's fixes read and make (ADR 0119): which
workflow a run's id names for the look, and a continue-as-new chain's keys."""

from __future__ import annotations

from stopline.integrations._temporal_closed import workflow_of
from stopline.integrations._temporal_runs import next_in_chain
from stopline.integrations.temporal import activity_run_id, run_id_of


def test_the_look_reads_back_only_workflow_ids_a_run_id_holds_as_they_are() -> None:
    """A workflow id's run is that id's; an execution's own run that execution's; a
    standalone activity's run and a derived id are no workflow the look can ask of."""
    execution = "01a2534b-78d5-71ab-8ec9-cc50b0a8be46"
    assert workflow_of("wf-1") == ("wf-1", "")
    assert workflow_of(run_id_of("wf-1", execution)) == ("wf-1", execution)
    assert workflow_of(activity_run_id("act-1", execution)) is None
    assert workflow_of("wf/ünï cødé:1") == ("wf/ünï cødé:1", "")  # printable: as it is
    assert workflow_of(run_id_of("x" * 2000)) is None  # derived
    assert workflow_of(run_id_of("x" * 2000, execution)) is None  # its head derived


def test_a_chains_keys_keep_an_executions_room_and_never_repeat() -> None:
    """``FIRST~N``: within a Temporal run id's 36 characters, a different name at each
    place of a chain of a thousand."""
    first = "01a2534b-78d5-71ab-8ec9-cc50b0a8be46"
    names, name = [first], first
    for _ in range(1000):
        name = next_in_chain(name)
        names.append(name)
    assert len(set(names)) == len(names)
    assert max(len(n) for n in names) == 36
    assert names[1] == f"{first[:34]}~1" and names[1000].endswith("~1000")
