"""A run's recovery as data, and the one sentence every surface says it in (R14, ADR 0066).

``guidance`` decides what following a receipt does: which steps (wait, a
reviewer's decision, resume, re-entry), for which run and operations, and what
the re-entry repeats. That is an ``Advice``: data, with no surface's words in
it. Saying it is here, once: ``Advice.say(terms)`` builds the sentence, and
``terms`` says each step the way the reader at hand does it. The library's
``LIBRARY_TERMS`` name its calls (``ledger.resume``); the CLI's and the
console's terms name a command or a page. A surface changes how a step is done,
never what following it repeats.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "LIBRARY_TERMS",
    "NEW_RUN",
    "Advice",
    "Do",
    "Step",
    "Terms",
    "reading_back",
    "reviewing",
]


class Do(enum.StrEnum):
    """A step of a recovery; a surface says how its reader does it (``Terms``)."""

    WAIT = "wait"  # until the run settles: there is nothing to do but wait
    REVIEW = "review"  # a reviewer decides the operations in review (``Step.op_ids``)
    RESUME = "resume"  # a principal allowed to resume resumes the run
    REENTER = "reenter"  # the application runs its workflow again under the same run id


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    do: Do
    run_id: str
    # the operations it is about, if known: a review's; a wait's that only a read-back
    # settles (in doubt, their tool declared a verifier)
    op_ids: tuple[str, ...] = ()
    # a review's: the latest horizon (R13) recorded of its operations, before which a
    # reviewer's "not committed" of one may be refused (its effect may still land); a
    # surface says it only while it is ahead (ADR 0092)
    horizon: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "do": self.do.value,
            "run_id": self.run_id,
            "op_ids": list(self.op_ids),
        }
        if self.do is Do.REVIEW:
            out["horizon"] = self.horizon
        return out


# How a surface says a step: the words of one clause ("resume with ...").
Terms = Mapping[Do, Callable[[Step], str]]


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _names(ids: Sequence[str]) -> str:
    """Up to three ids, quoted, and how many more."""
    shown = ", ".join(repr(i) for i in ids[:3])
    return shown if len(ids) <= 3 else f"{shown} and {len(ids) - 3} more"


def reviewing(step: Step) -> str:
    """What a review step asks, in every surface's words; each adds how it is done."""
    if not step.op_ids:
        return "resolve its review items"
    return f"a reviewer decides {_count(len(step.op_ids), 'operation', 'operations')} in review"


def reading_back(step: Step, how: str) -> str:
    """What a wait waits for when it is for calls in doubt (``Step.op_ids``), in every
    surface's words: their read-back, which only a process with their tool registered
    makes (ADR 0087); ``how``: who that is for the surface's reader. "" otherwise."""
    if step.do is not Do.WAIT or not step.op_ids:
        return ""
    one = len(step.op_ids) == 1
    return (
        f"; {_names(step.op_ids)} {'is' if one else 'are'} read back only by a process "
        f"that has {'its tool' if one else 'their tools'} registered: {how}"
    )


def _library_review(step: Step) -> str:
    calls = "ledger.resolve_review" if step.op_ids else "ledger.review_items, ledger.resolve_review"
    return f"{reviewing(step)} ({calls})"


LIBRARY_TERMS: Terms = {
    Do.WAIT: lambda step: (
        "wait until it settles (ledger.wait_settled)"
        + reading_back(step, "a ledger opened with it (a worker, or ledger.reconcile(tools=[...]))")
    ),
    Do.REVIEW: _library_review,
    Do.RESUME: lambda step: "resume with ledger.resume(run_id, by=...)",
    Do.REENTER: lambda step: "re-enter the run with the same run id",
}

NEW_RUN = "A new run would send every action again."


@dataclasses.dataclass(frozen=True, slots=True)
class Advice:
    """What to do with a run, and what doing it repeats: each field read from the ledger.

    ``steps`` in order; ``refused``: the run cannot resume until they are done (the
    first says what it waits for). Otherwise the steps resume and re-enter it, and the
    re-entry returns ``replayed`` from the ledger, sends ``sent`` (they provably never
    happened) with the same keys, and sends ``held`` (they may have happened) only
    once a read-back or a reviewer proves they did not. ``not_run_again`` operations
    of child runs that ended on their own are neither (``failed_children``,
    ``completed_children``: those runs). ``paused``: its workflow may still be waiting
    at its gate, and goes on by itself once resumed.
    """

    steps: tuple[Step, ...] = ()
    refused: bool = False
    paused: bool = False
    replayed: tuple[str, ...] = ()
    sent: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    not_run_again: int = 0
    failed_children: tuple[str, ...] = ()
    completed_children: tuple[str, ...] = ()

    def say(self, terms: Terms = LIBRARY_TERMS) -> str:
        """The recovery line, each step in ``terms``; "" when there is nothing to do."""
        if not self.steps:
            return ""
        said = [terms[step.do](step) for step in self.steps]
        if self.refused:
            return f"{said[0]}; resuming is refused until every operation is resolved. {NEW_RUN}"
        resume, reenter = said[0], said[-1]
        lead = f"{resume}, then {reenter}"
        if self.paused:
            lead += " if its workflow stopped (one still waiting at its gate goes on by itself)"
        return f"{lead}: {self._repeats()}{self._not_run_again()}{NEW_RUN}"

    def _repeats(self) -> str:
        sent, held = len(self.sent), len(self.held)
        them = "it" if sent == 1 else "them"
        clauses = [
            f"{_count(len(self.replayed), 'completed action is', 'completed actions are')} "
            "returned from the ledger, not repeated",
            f"{_count(sent, 'action', 'actions')} that never happened "
            f"{'is' if sent == 1 else 'are'} sent when the workflow reaches {them}"
            + (
                f", with the same {'key' if sent == 1 else 'keys'} ({_names(self.sent)})"
                if sent
                else ""
            ),
        ]
        if held:
            clauses.append(
                f"{_count(held, 'action', 'actions')} that may have happened "
                f"({_names(self.held)}) {'is' if held == 1 else 'are'} not sent again until "
                "a read-back or a reviewer proves "
                f"{'it' if held == 1 else 'they'} did not happen"
            )
        clauses.append("calls it had not reached yet are made as usual")
        return "; ".join(clauses) + ". "

    def _not_run_again(self) -> str:
        """The operations of child runs that ended on their own: the resume does not run
        them again, and the re-entry meets ``RunEnded``."""
        if not self.not_run_again:
            return ""
        where = []
        if self.failed_children:
            where.append(
                f"entering a child run that failed ({_names(self.failed_children)}) raises RunEnded"
            )
        if self.completed_children:
            where.append(
                "a call that never happened in a child run that completed "
                f"({_names(self.completed_children)}) raises RunEnded when reached"
            )
        n = self.not_run_again
        return (
            f"{_count(n, 'action', 'actions')} of child runs that ended on their own "
            f"{'is' if n == 1 else 'are'} not sent again: {'; '.join(where)}. "
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": [step.to_json() for step in self.steps],
            "refused": self.refused,
            "replayed": list(self.replayed),
            "sent": list(self.sent),
            "held": list(self.held),
            "paused": self.paused,
            "not_run_again": self.not_run_again,
            "failed_children": list(self.failed_children),
            "completed_children": list(self.completed_children),
        }
