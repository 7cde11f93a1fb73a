"""Tools: what a side-effecting call declares about its provider.

A tool is an async callable plus what its provider can do: cancel (until
accepted, after accepted, never), verify (a read-only read-back by
idempotency key) and compensate, and how long after its dispatch an effect
can still land (``settles_within``, its horizon: R13). Effectful tools receive a ``CallContext``
as their first argument when that parameter is named ``ctx`` or annotated
``CallContext``; through it they learn their idempotency key and report
acceptance and progress.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import types
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, NoReturn, ParamSpec, TypeVar, overload

from stopline.domain.limits import check_new_id, check_seconds
from stopline.domain.vocab import Cancellable
from stopline.errors import InvalidInput, NoAnswer, NoRun, Rejected

if TYPE_CHECKING:
    from stopline.domain.model import CancelState
    from stopline.runtime.context import CallContext

__all__ = [
    "Compensation",
    "NoAnswer",
    "ReadBack",
    "Rejected",
    "Tool",
    "Verdict",
    "Verifier",
    "as_verdict",
    "tool",
]

P = ParamSpec("P")
R = TypeVar("R")


class Compensation(enum.StrEnum):
    """Whether a cancel corrects this tool's completed operations by itself.

    ``never``: only when a principal asks (``ledger.compensate``); ``ask``: on
    cancel the correction is proposed to a principal (recorded on the operation);
    ``always``: on cancel the correction is queued at once.
    """

    NEVER = "never"
    ASK = "ask"
    ALWAYS = "always"


class Verdict(enum.StrEnum):
    """What a read-back of the destination found."""

    COMMITTED = "committed"
    NOT_COMMITTED = "not_committed"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class ReadBack:
    """A verifier's answer. A verifier reports what it found: ``COMMITTED`` (the
    effect is there), ``NOT_COMMITTED`` (it is not there), ``UNKNOWN`` (it could
    not tell). "Not there" proves the operation did not happen only once its
    horizon has passed (R13), or when the provider itself states the request has
    ended (``ended=True``: its own record, not a search): before that the runtime
    keeps verifying. A verifier may return the provider's recorded ``result``,
    which a replay then hands to the workflow."""

    verdict: Verdict
    ref: str = ""
    detail: str = ""
    result: Any = None
    ended: bool = False

    def __post_init__(self) -> None:  # "committed" is Verdict.COMMITTED; None is no verdict
        object.__setattr__(self, "verdict", as_verdict(self.verdict))

    @classmethod
    def of(cls, answer: object) -> ReadBack:
        """A verifier's answer, a ``ReadBack`` or a bare verdict, as a ``ReadBack``."""
        return answer if isinstance(answer, ReadBack) else cls(as_verdict(answer))


def as_verdict(value: object) -> Verdict:
    """``value`` as a ``Verdict`` (its string, ``"committed"``, is one too), else
    ``InvalidInput``: a verifier answering ``None``, ``True`` or ``"committed"`` as a
    string was read as "not committed", which proved nothing of the kind."""
    try:
        return Verdict(value)  # type: ignore[arg-type]  # checked here
    except ValueError:
        if _awaitable_answer(value):  # closed: it never runs
            raise InvalidInput(
                "verdict", _not_awaited("a verifier", "the verifier", value)
            ) from None
        raise InvalidInput("verdict", f"{value!r}: one of {', '.join(Verdict)}") from None


CancelFn = Callable[["CallContext"], Awaitable["bool | CancelState | None"]]
# The one verifier signature, everywhere a read-back is declared (``@tool.verifier``,
# ``StoplineMCP(verifiers=...)``, the framework adapters' ``verify=``): it reads
# ``ctx.key`` (and ``ctx.tool``, ``ctx.run_id``) and says what the destination shows.
Verifier = Callable[["CallContext"], Awaitable["ReadBack | Verdict"]]
VerifyFn = Verifier  # deprecated alias (0.2, removed in 0.3)
CompensateFn = Callable[["CallContext"], Awaitable[Any]]
ArgumentsCheck = Callable[[tuple[Any, ...], dict[str, Any]], None]
Shape = tuple[int, frozenset[str]]  # a call's positional count and keyword names
_SHAPES_KEPT = 64  # call shapes a tool remembers as taken (a tool is called a few ways)
# answers of these types are no awaitable, told without ``isawaitable``'s ABC check (the
# gate's path: most answers are JSON's)
_PLAIN = frozenset({str, int, float, bool, type(None), dict, list, tuple, bytes})


class Tool(Generic[R]):
    """A declared call. Build one with ``@stopline.tool(...)``."""

    def __init__(
        self,
        fn: Callable[..., Awaitable[R]],
        *,
        name: str | None = None,
        description: str = "",
        effects: bool = True,
        cancellable: Cancellable = Cancellable.NEVER,
        compensation: Compensation = Compensation.NEVER,
        settles_within: float | None = None,
    ) -> None:
        # the name is part of each call's key: a name no key may hold is refused here,
        # by its own name, not at the first call as the key derived from it
        self.name: str = check_new_id("tool", name or _own_name(fn))
        self.fn = _awaitable(fn, name)
        self.description = description or self.name.replace("_", " ")
        self.effects = effects
        self.cancellable = cancellable
        self.cancel_fn: CancelFn | None = None
        self.verify_fn: Verifier | None = None
        self.compensate_fn: CompensateFn | None = None
        self.compensation = compensation
        self.compensation_verify_fn: Verifier | None = None
        # R13: seconds after its dispatch by which any effect of a call has landed (or
        # never will); None: the effect ends with the local call, unless the call states
        # a horizon itself (``CallContext.settles_by``)
        self.settles_within = check_seconds("settles_within", settles_within)
        self.wants_context = effects and _first_param_is_context(fn)
        self._check_arguments: ArgumentsCheck | None = None  # ``check_arguments``
        # ``arguments_fit``'s: the function read, its signature, the call shapes it took
        self._signature: tuple[object, inspect.Signature | None, set[Shape]] = (None, None, set())

    def canceller(self, fn: CancelFn) -> CancelFn:
        """Register how to ask the provider to cancel.

        Return what the provider answered: True (it confirms the request ended
        without effect), False (it refuses), None (asked; no answer to tell), or
        a ``CancelState``.
        """
        self.cancel_fn = fn
        if self.cancellable is Cancellable.NEVER:
            self.cancellable = Cancellable.UNTIL_ACCEPTED
        return fn

    def verifier(self, fn: Verifier) -> Verifier:
        """Register the read-only read-back by idempotency key."""
        self.verify_fn = fn
        return fn

    def compensator(self, fn: CompensateFn) -> CompensateFn:
        """Register the correction of a committed call; ``ctx.compensates`` is its key."""
        self.compensate_fn = fn
        return fn

    def compensation_verifier(self, fn: Verifier) -> Verifier:
        """Register the read-back of a correction, by the correction's own key."""
        self.compensation_verify_fn = fn
        return fn

    if not TYPE_CHECKING:  # at run time only: typed, a tool is no callable (``run.call``'s R)

        def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
            """A tool is called through a run's gate, never directly: ``NoRun`` (it was
            ``TypeError: 'Tool' object is not callable``), and nothing is sent."""
            raise NoRun(
                f"tool {self.name!r} is called through a run: `await run.call({self.name},"
                " ...)` inside `async with ledger.run(...) as run` (its function is not called)"
            )

    @property
    def check_arguments(self) -> ArgumentsCheck:
        """Checks a call's arguments before anything is done (the gate, a read): raises
        ``InvalidInput`` for arguments the tool could never send (an MCP tool's: JSON).
        By default, arguments its function cannot take (``arguments_fit``)."""
        return self._check_arguments or self.arguments_fit

    @check_arguments.setter
    def check_arguments(self, check: ArgumentsCheck | None) -> None:
        self._check_arguments = check

    def arguments_fit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``InvalidInput`` naming ``arguments`` unless the tool's function takes these
        (after its context): a call its function could not take failed after the gate,
        an operation in doubt for a call that never ran (ADR 0086)."""
        fn, signature, fits = self._signature
        if fn is not self.fn:  # read once for each function (an integration sets its own)
            try:
                signature = inspect.signature(self.fn)
            except (TypeError, ValueError):  # no signature to read: the call will tell
                signature = None
            self._signature = (self.fn, signature, fits := set())
        # whether arguments bind depends on how many are positional and the keywords'
        # names only: a shape that bound once binds again (the gate's path: no bind)
        shape = (len(args), frozenset(kwargs))
        if signature is None or shape in fits:
            return
        try:
            signature.bind(*((None,) if self.wants_context else ()), *args, **kwargs)
        except TypeError as exc:
            raise InvalidInput("arguments", f"tool {self.name!r} cannot take them: {exc}") from None
        if len(fits) < _SHAPES_KEPT:
            fits.add(shape)

    def answer(self, value: R, *, of: str = "") -> R:
        """``value``, what this tool's function returned (or its ``of``: "compensator"),
        as its answer; an awaitable is none (ADR 0089): ``TypeError`` naming the tool and
        the fix, which the gate records as any exception of the tool (``unknown``: its
        body may have acted before it returned). A coroutine not started is closed: its
        work never runs, nor warns later that it was never awaited. Another awaitable (a
        Future, a Task) is left as it is: it may be shared, and what it does may still
        land (read back)."""
        if not _awaitable_answer(value):
            return value
        who = f"the {of} of tool {self.name!r}" if of else f"tool {self.name!r}"
        raise TypeError(_not_awaited(who, f"the {of or 'tool'}", value))

    def declares_as(self, other: Tool[Any]) -> bool:
        """Whether ``other`` declares what this tool declares, for the ledger's tools by
        name (``Core.register_tool``): what a call of either records and how its
        operations are read back, cancelled and corrected. The callable itself is not
        compared (an integration binds a new one to each call of one declared tool);
        each capability is the same function (``same_function``)."""
        return other is self or (
            _declared(self) == _declared(other)
            and all(map(same_function, _capabilities(self), _capabilities(other)))
        )

    def __repr__(self) -> str:
        return f"<Tool {self.name} effects={self.effects} cancellable={self.cancellable.value}>"


def _declared(t: Tool[Any]) -> tuple[object, ...]:
    return (t.effects, t.cancellable, t.compensation, t.settles_within)


def _capabilities(t: Tool[Any]) -> tuple[object, ...]:
    return (t.cancel_fn, t.verify_fn, t.compensate_fn, t.compensation_verify_fn)


def same_function(a: object, b: object, seen: frozenset[tuple[int, int]] = frozenset()) -> bool:
    """Whether two capabilities are one function: the same object (or equal ones); or
    made again from one declaration, as integrations make a tool for each call of a
    framework tool: a ``functools.partial`` of the same function with the same
    arguments, a closure of the same code over the same values.

    A method is the same function bound to the same object, or to an equal one: two
    instances of one class configured for two destinations are two declarations (the
    second's calls were read back with the first's ``verify``, ADR 0086). An
    integration that binds a capability to an object it makes for each call declares
    that object's equality: equal when it reads back, cancels and corrects the same.
    """
    if _same_value(a, b) or (id(a), id(b)) in seen:  # a closure over itself: compared
        return True
    seen |= {(id(a), id(b))}
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return (
            same_function(a.func, b.func, seen)
            and len(a.args) == len(b.args)
            and all(same_function(x, y, seen) for x, y in zip(a.args, b.args, strict=True))
            and a.keywords.keys() == b.keywords.keys()
            and all(same_function(v, b.keywords[k], seen) for k, v in a.keywords.items())
        )
    if isinstance(a, types.MethodType) and isinstance(b, types.MethodType):
        return a.__func__ is b.__func__ and _same_value(a.__self__, b.__self__)
    if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
        cells = (a.__closure__ or (), b.__closure__ or ())
        return (
            a.__code__ is b.__code__
            and len(cells[0]) == len(cells[1])
            and all(_same_cell(x, y, seen) for x, y in zip(*cells, strict=True))
        )
    return False


def _same_cell(a: types.CellType, b: types.CellType, seen: frozenset[tuple[int, int]]) -> bool:
    try:
        return same_function(a.cell_contents, b.cell_contents, seen)
    except ValueError:  # an empty cell (a name not bound yet)
        return False


def _same_value(a: object, b: object) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # an ``==`` that cannot answer: not shown to be the same
        return False


def _awaitable_answer(value: object) -> bool:
    """Whether ``value`` is an awaitable (JSON's types told without ``isawaitable``'s ABC
    check: the gate's path)."""
    return type(value) not in _PLAIN and inspect.isawaitable(value)


def _not_awaited(who: str, inside: str, value: object) -> str:
    """Why ``value``, an awaitable, is no answer of ``who`` (a tool, a verifier), to be
    awaited ``inside`` it; a coroutine that has not started is closed here (it will not
    run)."""
    fix = f"await it inside {inside} (`return await ...`)"
    if (
        isinstance(value, types.CoroutineType)
        and inspect.getcoroutinestate(value) == inspect.CORO_CREATED
    ) or (
        isinstance(value, types.GeneratorType)
        and inspect.getgeneratorstate(value) == inspect.GEN_CREATED
    ):
        value.close()
        what = getattr(value, "__qualname__", type(value).__name__)
        return f"{who} returned an unawaited coroutine {what!r}: its work never ran; {fix}"
    return (
        f"{who} returned an awaitable ({type(value).__name__}) instead of its "
        f"answer: it was not awaited, and what it does may still run; {fix}"
    )


def _own_name(fn: object) -> str:
    """The name a tool takes when none is given: its function's, through partials, or a
    callable object's class's. Each of them was "tool", and two such tools one name:
    their receipt lines could not be told apart."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def _first_param_is_context(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if not params:
        return False
    first = params[0]
    annotation = first.annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return first.name == "ctx" or text.endswith("CallContext")


def _awaitable(fn: Callable[..., Awaitable[R]], name: str | None) -> Callable[..., Awaitable[R]]:
    """``fn`` if calling it gives something to await; a plain ``def`` or an async
    generator is refused when the tool is made (``InvalidInput``): called after the gate,
    its effect ran and then awaiting its answer failed, an untyped error and an
    operation in doubt."""
    what = name or getattr(fn, "__name__", repr(fn))
    if isinstance(fn, Tool):  # its call raises NoRun: after the gate, a call in doubt
        raise InvalidInput("tool", f"{fn!r} is a tool already: call it with run.call(tool)")
    if not callable(fn):  # it would pass the gate and fail there: a call in doubt
        raise InvalidInput("tool", f"{fn!r} is not callable: a tool is an async function")
    if inspect.isasyncgenfunction(fn):
        why = "is an async generator: a tool is an async function that returns its answer"
    elif inspect.isroutine(fn) and not inspect.iscoroutinefunction(fn):
        why = (
            "is a plain function (def): a tool is an async function; run blocking work "
            "with `await anyio.to_thread.run_sync(...)` inside one"
        )
    else:
        return fn
    raise InvalidInput("tool", f"{what!r} {why}")


@overload
def tool(fn: Callable[P, Awaitable[R]], /) -> Tool[R]: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str = "",
    effects: bool = True,
    cancellable: Cancellable = Cancellable.NEVER,
    compensation: Compensation = Compensation.NEVER,
    settles_within: float | None = None,
) -> Callable[[Callable[P, Awaitable[R]]], Tool[R]]: ...


def tool(
    fn: Callable[P, Awaitable[R]] | None = None,
    /,
    *,
    name: str | None = None,
    description: str = "",
    effects: bool = True,
    cancellable: Cancellable = Cancellable.NEVER,
    compensation: Compensation = Compensation.NEVER,
    settles_within: float | None = None,
) -> Tool[R] | Callable[[Callable[P, Awaitable[R]]], Tool[R]]:
    """Declare a tool; ``effects=False`` marks a read that needs no gate record. Its
    name, unless ``name=``, is its function's (through ``functools.partial``), or a
    callable object's class's: a call's tool in the ledger and on its receipt line."""

    def wrap(f: Callable[P, Awaitable[R]]) -> Tool[R]:
        return Tool(
            f,
            name=name,
            description=description,
            effects=effects,
            cancellable=cancellable,
            compensation=compensation,
            settles_within=settles_within,
        )

    return wrap(fn) if fn is not None else wrap
