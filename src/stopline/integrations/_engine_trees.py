"""Which engine workflow each run of a fenced tree is, for a process that opened none.

A stopline cancel fences a run and the child runs it owns exclusively
(``cancel_collecting``), then asks the engine to cancel their workflows. A run's
id is its workflow's id only in the usual case: a derived id (``HEAD#sha256:HEX``,
ADR 0085) or, on Temporal, an execution's own run (``WORKFLOW_ID@run:RUN_ID``,
ADR 0050) is not. The worker that opened a run remembers its workflow's id
(``EngineGate.remember_engine_id``); a process with no worker (``dbos.cancel``,
``temporal.cancel``) finds it through the engine's own record of each
workflow's children, one level of the tree at a time, written once here for
both engines.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence

from stopline.integrations._engines import engine_run_id

__all__ = ["Children", "RunsOf", "workflows_of"]

# the child workflows (the engine's ids) of these workflows, as the engine records them
Children = Callable[[list[str]], Awaitable[list[str]]]
# those of these runs (stopline's ids) that are the runs of this workflow (the engine's id)
RunsOf = Callable[[str, Collection[str]], Iterable[str]]


def _its_own(workflow_id: str, runs: Collection[str]) -> Iterable[str]:
    """The workflow id's run, if it is one of ``runs`` (``engine_run_id``)."""
    run_id = engine_run_id(workflow_id)
    return (run_id,) if run_id in runs else ()


async def workflows_of(
    workflow_id: str,
    run_id: str,
    fenced: Sequence[str],
    children: Children,
    runs_of: RunsOf = _its_own,
) -> list[str]:
    """The engine's workflow id of each ``fenced`` run, in order: ``workflow_id`` for
    ``run_id`` (the root); a descendant's found among the root's descendants through the
    engine's parent links (``children``), level by level until each fenced run has its
    workflow. A run no descendant is found for is named by its id: its workflow is no
    longer one of the tree's (it ended, and its parent's close policy has reached it)."""
    found = {run_id: workflow_id}
    missing = {f for f in fenced if f not in found}
    parents, seen = [workflow_id], {workflow_id}
    while parents and missing:
        level = [child for child in await children(parents) if child not in seen]
        seen.update(level)
        for child in level:
            for run in list(runs_of(child, missing)):
                found[run] = child
                missing.discard(run)
        parents = level
    return [found.get(f, f) for f in fenced]
