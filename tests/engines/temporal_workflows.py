"""Workflows for the Temporal tests, in a module of their own (Temporal's sandbox
re-imports it: it imports only temporalio and the standard library)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import (
    ActivityCancellationType,
    ChildWorkflowCancellationType,
    ParentClosePolicy,
)


@dataclasses.dataclass
class Plan:
    activities: list[str]
    cancellation: str = "TRY_CANCEL"
    wait_for_go: bool = False
    heartbeat_timeout: float = 1.0
    maximum_attempts: int = 0  # 0: Temporal's default, unlimited
    children: list[str] = dataclasses.field(default_factory=list)  # "exclusive" / "shared"
    child_activities: list[str] = dataclasses.field(default_factory=list)
    fail_first_attempt: bool = False  # the workflow's code fails its first attempt
    hold_after: bool = False  # wait for "go" again after the activities
    start_to_close: float = 30.0


@workflow.defn
class Pipeline:
    def __init__(self) -> None:
        self._go = False
        self._gos = 0  # how many "go" signals came

    @workflow.signal
    def go(self) -> None:
        self._go = True
        self._gos += 1

    @workflow.run
    async def run(self, plan: Plan) -> list[Any]:
        if plan.fail_first_attempt and workflow.info().attempt == 1:
            raise ApplicationError("the first attempt fails before any activity")
        if plan.wait_for_go:
            await workflow.wait_condition(lambda: self._go)
        out: list[Any] = []
        for n, ownership in enumerate(plan.children):
            child_plan = Plan(plan.child_activities, wait_for_go=True)
            shared = ownership == "shared"
            # a shared child outlives its parent: Temporal neither cancels nor closes it
            await workflow.start_child_workflow(
                Pipeline.run,
                child_plan,
                id=f"{workflow.info().workflow_id}-{ownership}-{n}",
                parent_close_policy=(
                    ParentClosePolicy.ABANDON if shared else ParentClosePolicy.REQUEST_CANCEL
                ),
                cancellation_type=(
                    ChildWorkflowCancellationType.ABANDON
                    if shared
                    else ChildWorkflowCancellationType.WAIT_CANCELLATION_COMPLETED
                ),
            )
        for name in plan.activities:
            result = await workflow.execute_activity(
                name,
                args=[f"{name} of {workflow.info().workflow_id}"],
                start_to_close_timeout=timedelta(seconds=plan.start_to_close),
                heartbeat_timeout=timedelta(seconds=plan.heartbeat_timeout),
                cancellation_type=ActivityCancellationType[plan.cancellation],
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(milliseconds=50),
                    backoff_coefficient=1.0,
                    maximum_attempts=plan.maximum_attempts,
                ),
            )
            out.append(result)
        if plan.hold_after:  # a "go" of its own, after the one it may have waited for
            await workflow.wait_condition(lambda: self._gos > plan.wait_for_go)
        elif plan.children:
            await workflow.wait_condition(lambda: self._go)
        return out


@workflow.defn
class GiveUp:
    """Starts ``upload``, and cancels it itself on "go" (its own code: no workflow cancel)."""

    def __init__(self) -> None:
        self._go = False

    @workflow.signal
    def go(self) -> None:
        self._go = True

    @workflow.run
    async def run(self) -> str:
        upload = workflow.start_activity(
            "upload",
            args=[f"upload of {workflow.info().workflow_id}"],
            start_to_close_timeout=timedelta(seconds=30),
            heartbeat_timeout=timedelta(seconds=1),
        )
        await workflow.wait_condition(lambda: self._go)
        upload.cancel()
        try:
            await upload
        except ActivityError:  # cancelled, as asked
            return "gave up"
        return "it finished first"


@workflow.defn
class Chain:
    """``upload`` once per execution, ``rounds`` executions joined by continue-as-new;
    the last waits for "go". Returns each execution's (run id, original run id)."""

    def __init__(self) -> None:
        self._go = False

    @workflow.signal
    def go(self) -> None:
        self._go = True

    @workflow.run
    async def run(self, rounds: int, seen: list[list[str]]) -> list[list[str]]:
        info = workflow.info()
        await workflow.execute_activity(
            "upload",
            args=[f"upload {len(seen)} of {info.workflow_id}"],
            start_to_close_timeout=timedelta(seconds=30),
            heartbeat_timeout=timedelta(seconds=1),
        )
        seen = [*seen, [info.run_id, info.original_execution_run_id]]
        if rounds > 1:
            workflow.continue_as_new(args=[rounds - 1, seen])
        await workflow.wait_condition(lambda: self._go)
        return seen


@workflow.defn
class Updatable:
    """``upload`` (WAIT_CANCELLATION_COMPLETED: the workflow stays open while it ends);
    the update ``send`` runs ``notify`` when asked, whatever the workflow is doing."""

    @workflow.update
    async def send(self, text: str) -> Any:
        return await workflow.execute_activity(
            "notify",
            args=[text],
            start_to_close_timeout=timedelta(seconds=30),
            heartbeat_timeout=timedelta(seconds=1),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=50)),
        )

    @workflow.run
    async def run(self) -> Any:
        return await workflow.execute_activity(
            "upload",
            args=[f"upload of {workflow.info().workflow_id}"],
            start_to_close_timeout=timedelta(seconds=30),
            heartbeat_timeout=timedelta(seconds=1),
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
