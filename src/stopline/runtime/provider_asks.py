"""Asking a call's provider to cancel it, for the settler (R12, R14).

A cancel delivered to a call in flight asks its provider to cancel, through
whatever the call's interface offers (its own ``cancel_via`` channel, else its
tool's canceller), unless its policy says the provider cannot (then the record
says why it was not asked). What was asked, how, and what came back are
recorded; the run's settling is held until the answer is in (it is part of the
receipt). Split from ``settle`` (the settler's ``ask_provider_cancel``).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import anyio

from stopline.domain.model import CANCEL_ANSWERS, CancelState, Evidence
from stopline.domain.vocab import Cancellable, EvidenceKind, NoteKind, OpEvent
from stopline.errors import describe
from stopline.ledger.backend import Note, OutcomeUpdate
from stopline.runtime.context import CallContext

if TYPE_CHECKING:
    from stopline.runtime.core import Core
    from stopline.runtime.settle import Settler

__all__ = ["CancelAnswer", "ProviderAsks"]


@dataclasses.dataclass(frozen=True, slots=True)
class CancelAnswer:
    """A provider's answer to a cancel with its own words: what an integration's
    ``cancel_via`` ask may return (an MCP ``tasks/cancel`` answered with an error:
    ``CancelState.ERROR`` and the error), beside what a canceller returns."""

    state: CancelState
    detail: str = ""


def _answer_of(answer: object) -> tuple[CancelState, str]:
    """A canceller's return value as the answer it reports, and its words."""
    if isinstance(answer, CancelAnswer):
        return CancelState.parse(answer.state.value), answer.detail
    if isinstance(answer, CancelState):
        return CancelState.parse(answer.value), ""
    if answer is True:
        return CancelState.CONFIRMED, ""
    if answer is False:
        return CancelState.REFUSED, ""
    return CancelState.ASKED, ""  # asked; the provider gave no answer to tell


def _answer_note(ctx: CallContext, state: CancelState, detail: str, channel: str) -> Note:
    """The note of a provider's answer (or of why it was not asked)."""
    data: dict[str, Any] = {"answer": state.value, "detail": detail}
    if channel:
        data["channel"] = channel
    kind = NoteKind(f"cancel_{state.value}")  # refused, error, not_asked, not_supported, asked
    return Note(ctx.op_id, kind, data, cancel_state=state)


class ProviderAsks:
    """The settler's requests to providers: each asked in the background, the answers
    known without asking written together."""

    def __init__(self, core: Core, settler: Settler) -> None:
        self._core = core
        self._settler = settler
        # answers known without asking, to write (their notes built by the writing task,
        # after the cancel that found them has interrupted what it had to)
        self._answers: list[tuple[CallContext, CancelState, str, str]] = []
        self._written = anyio.Event()  # set once those in ``_answers`` are written

    def ask(self, ctx: CallContext, *, cut: bool = False) -> anyio.Event | None:
        """Deliver a cancel request to a call in flight, through whatever its interface
        offers (its own ``cancel_via`` channel, else its tool's canceller); record what
        was asked, how, and (in the background) what came back (R14). ``cut``: the
        call's awaiting scope was cut, which by itself tells the provider when its
        interface says so (``cut_sends``).

        Returns, when the provider is asked, an event set once the request is recorded
        and handed to the provider (or could not be): what ``cancel()`` waits for."""
        tool = ctx.tool
        never = tool.cancellable is Cancellable.NEVER or (
            ctx.is_accepted and tool.cancellable is Cancellable.UNTIL_ACCEPTED
        )
        if cut and ctx.cut_sends and never:
            # R14: the record says what was sent, although its policy says not to ask
            policy = (
                "its tool is not declared cancellable"
                if tool.cancellable is Cancellable.NEVER
                else "its provider had accepted it, and its tool cancels only until then"
            )
            why = (
                f"the call was cut here, and the cut sent its provider a cancel "
                f"({ctx.cut_sends}); {policy} (R12)"
            )
            written = self._answered(ctx, CancelState.ASKED, why, ctx.cut_sends)
            if ctx.canceller is not None:  # what the cut's cancel got back, when it answers
                self._core.spawn(self._collect, ctx, written)
            return None
        if tool.cancellable is Cancellable.NEVER:
            # the record cannot tell a declared ``never`` from the default (ADR 0066)
            why = "not declared cancellable: its provider is not asked to cancel it (R12)"
            self._answered(ctx, CancelState.NOT_ASKED, why, "")
            return None
        if ctx.is_accepted and tool.cancellable is Cancellable.UNTIL_ACCEPTED:
            why = "the provider accepted it and cancels only until then: not asked"
            self._answered(ctx, CancelState.NOT_ASKED, why, "")
            return None
        if ctx.canceller is None and tool.cancel_fn is None:
            why = "the call's interface offers no way to ask its provider to cancel"
            self._answered(ctx, CancelState.NOT_SUPPORTED, why, "")
            return None
        sent = anyio.Event()
        self._core.spawn(self._ask, ctx, sent)
        return sent

    def _answered(
        self, ctx: CallContext, state: CancelState, detail: str, channel: str
    ) -> anyio.Event:
        """Record an answer known without asking. The answers one cancel delivers at once
        (a tree's calls in flight) are written together, in one transaction: the event
        returned is set once they are (or could not be)."""
        if not self._answers:
            self._written = anyio.Event()
            self._core.spawn(self._note_answers)  # starts after the caller's loop is done
        self._answers.append((ctx, state, detail, channel))
        return self._written

    async def _note_answers(self) -> None:
        core = self._core
        answers, self._answers = self._answers, []
        written = self._written
        try:
            await core.backend.note_many([_answer_note(*answer) for answer in answers])
        finally:
            written.set()
        for run_id in dict.fromkeys(ctx.run_id for ctx, *_ in answers):
            core.changed(run_id)

    async def _collect(self, ctx: CallContext, written: anyio.Event) -> None:
        """A cut sent its call's provider a cancel (``cut_sends``) that its policy would
        not have asked: what that cancel got back (an MCP ``tasks/cancel`` is a request,
        answered), recorded after the cut's own record of it (R14). The call's own ask
        collects the answer and sends nothing more; the run settles after it."""
        assert ctx.canceller is not None
        channel, ask = ctx.canceller
        settler = self._settler
        release = settler.hold_steps([ctx.run_id])
        try:
            async with settler.working():
                state, detail = CancelState.ASKED, ""
                # an ask that raises or outlasts the wait tells nothing: the cut's record stands
                with anyio.move_on_after(self._core.cancel_answer_timeout), suppress(Exception):
                    state, detail = _answer_of(await ask())
                await written.wait()
                if state in CANCEL_ANSWERS:
                    await self._record(ctx, state, detail, channel)
        finally:
            release()
        await settler.advance(ctx.run_id)

    async def _ask(self, ctx: CallContext, sent: anyio.Event) -> None:
        """Ask, and hold the run's settlement until the provider has answered: its answer
        (a confirmed or refused cancel) is part of the receipt, which must not change
        after the run is called settled. ``sent`` is set once the request is recorded
        and handed to the provider, or once it cannot be."""
        settler = self._settler
        release = settler.hold_steps([ctx.run_id])
        try:
            async with settler.working():
                await self._ask_provider(ctx, sent)
        finally:
            sent.set()
            release()
        await settler.advance(ctx.run_id)

    async def _ask_provider(self, ctx: CallContext, sent: anyio.Event) -> None:
        core = self._core
        if ctx.canceller is not None:
            channel, ask = ctx.canceller
        else:
            assert ctx.tool.cancel_fn is not None
            channel, fn = "canceller", ctx.tool.cancel_fn

            async def ask() -> object:
                return await fn(ctx)

        at = time.time()
        data = {"channel": channel, "at": at}
        await core.backend.note(
            ctx.op_id, NoteKind.CANCEL_ASKED, data, cancel_state=CancelState.ASKED
        )
        core.changed(ctx.run_id)
        answered, answer, detail = False, None, ""
        try:
            # a provider that never answers must not hold the run open forever
            with anyio.move_on_after(core.cancel_answer_timeout):
                sent.set()  # the request leaves in this same step: cancel() may return
                answer = await ask()
                answered = True
        except Exception as exc:  # an error is no refusal: it says nothing of the work
            answered, answer = True, CancelAnswer(CancelState.ERROR, describe(exc))
        state, said = _answer_of(answer) if answered else (CancelState.UNANSWERED, "")
        await self._record(ctx, state, detail or said, channel)

    async def _record(
        self, ctx: CallContext, state: CancelState, detail: str, channel: str
    ) -> None:
        """The provider's answer (through ``channel``) as the operation's cancel state."""
        core = self._core
        if state is CancelState.CONFIRMED:
            await core.outcomes.resolve(
                ctx.op_id,
                OutcomeUpdate(
                    OpEvent.CANCEL_CONFIRMED,
                    [Evidence(EvidenceKind.PROVIDER_RECEIPT, "cancel_confirmed", channel)],
                    cancel_state=CancelState.CONFIRMED,
                ),
            )
        elif state is CancelState.UNANSWERED:
            data = {"channel": channel, "after_s": core.cancel_answer_timeout}
            await core.backend.note(
                ctx.op_id, NoteKind.CANCEL_UNANSWERED, data, cancel_state=CancelState.UNANSWERED
            )
            core.changed(ctx.run_id)  # the operation's own outcome (or read-back) decides
        elif state is not CancelState.ASKED:
            note = _answer_note(ctx, state, detail, channel)
            await core.backend.note(note.op_id, note.kind, note.data, note.cancel_state)
            core.changed(ctx.run_id)
