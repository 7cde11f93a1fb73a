"""What a ledger holds, read under its access policy (R11): ``ledger.reads``.

The public way to read runs, operations and the log; ``ledger.backend`` is the
storage seam, for integrations and tools, and checks nobody. With ``by``, a
run the principal may not see is answered as unknown (``UnknownRun``: its
existence is not disclosed); without ``by`` the caller is this process itself,
as for ``Ledger.receipt``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from stopline.domain.guidance import tree_runs_read
from stopline.domain.lifecycle import AccessPolicy, Principal
from stopline.domain.limits import check_id, check_limit
from stopline.domain.model import EventRecord, OperationRecord, RunRecord
from stopline.domain.vocab import RunState
from stopline.errors import InvalidInput, UnknownOperation, UnknownRun
from stopline.ledger.backend import Queries

__all__ = ["Reads"]


class Reads:
    """Reads of one ledger, each checked against its access policy when ``by`` is given."""

    def __init__(self, queries: Callable[[], Queries], access: Callable[[], AccessPolicy]) -> None:
        self._queries = queries  # the backend once the ledger is open
        self._access = access

    async def run(self, run_id: str, *, by: str | Principal | None = None) -> RunRecord:
        sees = self._sees(by)
        run = await self._queries().get_run(run_id)
        if not sees(run):
            raise UnknownRun(run_id)
        return run

    async def runs(
        self,
        *,
        by: str | Principal | None = None,
        state: RunState | str | None = None,
        owner: str | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        """Newest first: the runs ``by`` may see, among the ``limit`` newest that match."""
        state, owner, limit, sees = *_listing(state, owner, limit), self._sees(by)
        found = await self._queries().list_runs(state=state, owner=owner, limit=limit)
        return list(filter(sees, found))

    async def runs_with_trees(
        self,
        *,
        by: str | Principal | None = None,
        state: RunState | str | None = None,
        owner: str | None = None,
        limit: int = 100,
    ) -> list[tuple[RunRecord, list[OperationRecord]]]:
        """``runs``, each with its tree's operations (what its receipt is built from),
        the listing and every run's read from one snapshot."""
        state, owner, limit, sees = *_listing(state, owner, limit), self._sees(by)
        found = await self._queries().list_trees(state=state, owner=owner, limit=limit)
        return [(run, ops) for run, ops in found if sees(run)]

    def _sees(self, by: str | Principal | None) -> Callable[[RunRecord], bool]:
        """Whether ``by`` may see a run (R11); anyone may without ``by`` (this process)."""
        if by is None:
            return lambda run: True
        principal, access = Principal.of(by), self._access()
        check_id("by", principal.id)  # before the read it filters
        return lambda run: access.visible(principal, run)

    async def operations(
        self, run_id: str, *, by: str | Principal | None = None, descendants: bool = False
    ) -> list[OperationRecord]:
        return (await self.run_and_operations(run_id, by=by, descendants=descendants))[1]

    async def run_and_operations(
        self, run_id: str, *, by: str | Principal | None = None, descendants: bool = False
    ) -> tuple[RunRecord, list[OperationRecord]]:
        """The run and its operations from one snapshot, in one read: what a receipt is
        built from (two reads could mix moments, and the second would wait behind every
        write queued in between)."""
        sees = self._sees(by)
        run, ops = await self._queries().run_and_operations(run_id, descendants=descendants)
        if not sees(run):
            raise UnknownRun(run_id)
        return run, ops

    async def trees(
        self, run_ids: Sequence[str], *, by: str | Principal | None = None
    ) -> dict[str, tuple[RunRecord, list[OperationRecord]]]:
        """``run_and_operations`` with ``descendants`` of many runs, from one snapshot:
        those that exist (and ``by`` may see), by id, each with its tree's operations."""
        if isinstance(run_ids, str):  # each of its characters would be read as an id
            raise InvalidInput("run_ids", "a sequence of run ids, not one string")
        ids, sees = [check_id("run_id", run_id) for run_id in run_ids], self._sees(by)
        found = await self._queries().trees_and_operations(ids)
        return {f[0].id: f for f in found if not isinstance(f, UnknownRun) and sees(f[0])}

    async def tree_runs(
        self, trees: Iterable[tuple[RunRecord, Sequence[OperationRecord]]]
    ) -> dict[str, RunRecord]:
        """The runs of these trees that their receipts' recovery lines read
        (``guidance.tree_runs_read``) and those between them and their roots, by id:
        none for most receipts, else a read per level of the trees (a child that ended
        has ended for good: a read after the trees' snapshot tells the same)."""
        roots: set[str] = set()
        found: dict[str, RunRecord] = {}
        wanted: set[str] = set()
        for run, ops in trees:
            roots.add(run.id)
            wanted |= tree_runs_read(run, ops)
        while wanted:
            read = await self._queries().get_runs(sorted(wanted))
            found.update(read)
            above = {r.parent_id for r in read.values() if r.parent_id is not None}
            wanted = above - roots - found.keys()
        return found

    async def operation(self, op_id: str, *, by: str | Principal | None = None) -> OperationRecord:
        op = await self._queries().get_operation(op_id)
        if by is not None:
            try:
                await self.run(op.run_id, by=by)
            except UnknownRun:
                raise UnknownOperation(op_id) from None
        return op

    async def events(self, run_id: str, *, by: str | Principal | None = None) -> list[EventRecord]:
        await self.run(run_id, by=by)
        return await self._queries().events(run_id)


def _listing(
    state: RunState | str | None, owner: str | None, limit: int
) -> tuple[RunState | None, str | None, int]:
    """A listing's filters, each checked before anything is read (``InvalidInput``
    naming it): a state by its member or its word, an owner as an id, a limit."""
    if state is not None:
        try:
            state = RunState(state)
        except ValueError:
            words = ", ".join(s.value for s in RunState)
            raise InvalidInput("state", f"{state!r} is not a run state ({words})") from None
    return state, None if owner is None else check_id("owner", owner), check_limit("limit", limit)
