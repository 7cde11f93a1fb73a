"""Pictures the console draws on the server, as inline SVG: no script, no CDN.

``run_timeline``: a run on a time axis, its phases on the first row and each
operation on a row of its own (from the gate to the event that resolved it,
coloured by its status, each ledger event a dot with its words), the cancel
and the settle marked as vertical lines. ``settle_chart``: how long cancelled
runs took from the cancel to settled, as a histogram with p50 and p99 marked.

Every value drawn comes from the ledger's events; every text is escaped, its
bidirectional controls drawn by name (``shown.visible``: an SVG label holds no ``<bdi>``).
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

from stopline.cli.views import TimelineEntry, fmt_seconds
from stopline.console.shown import visible
from stopline.domain.model import OperationRecord
from stopline.domain.vocab import LogKind, OpStatus, RunEvent

__all__ = ["run_timeline", "settle_chart"]

WIDTH = 1000
LABEL = 230  # the left column: row labels
PLOT = WIDTH - LABEL - 20
ROW = 26
# Painted with presentation attributes: the console's CSP admits no <style> without a nonce.
_STATUS_FILL = {
    OpStatus.COMMITTED: "#3d9a5b",
    OpStatus.COMPENSATED: "#2f8f8f",
    OpStatus.NOT_COMMITTED: "#aab3bc",
    OpStatus.PREVENTED: "#aab3bc",
    OpStatus.REQUESTED: "#e0a43a",
    OpStatus.ACCEPTED: "#e0a43a",
    OpStatus.COMPENSATING: "#e0a43a",
    OpStatus.UNKNOWN: "#c8414a",
    OpStatus.NEEDS_REVIEW: "#c8414a",
    OpStatus.COMPENSATION_FAILED: "#c8414a",
}
_MARK = {"cancel": "#b4232c", "settled": "#1f7a3f", "p50": "#1b5e8c", "p99": "#9a6400"}
_FONT = 'font-family="system-ui, sans-serif"'
_TEXT = {
    "lbl": f'{_FONT} font-size="12" fill="#1d2329"',
    "axis": f'{_FONT} font-size="11" fill="#67717b"',
}
_GRID = 'stroke="#e3e7eb" stroke-width="1"'
_SETTLE_KINDS: dict[str, str] = {RunEvent.SETTLED: "settled", RunEvent.ESCALATE: "needs review"}


def _esc(text: str) -> Markup:
    return escape(visible(text))


def _svg(height: int, testid: str, title: str, body: list[str]) -> Markup:
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" data-testid="{testid}" '
        f'viewBox="0 0 {WIDTH} {height}" width="100%" aria-label="{_esc(title)}">'
        f"<title>{_esc(title)}</title>{''.join(body)}</svg>"
    )


def _text(x: float, y: float, text: str, cls: str = "lbl", anchor: str = "start") -> str:
    return f'<text {_TEXT[cls]} x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{_esc(text)}</text>'


def _mark(name: str, x: float, top: float, bottom: float, title: str) -> str:
    return (
        f'<line data-mark="{name}" stroke="{_MARK[name]}" stroke-width="2" '
        f'stroke-dasharray="5 3" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}">'
        f"<title>{_esc(title)}</title></line>"
    )


def _beside(x: float, y: float, text: str, *, left: bool = False) -> str:
    """A mark's label beside its line: to the right, or to the left (asked, or at the edge)."""
    if left or x + 7 * len(text) + 4 > WIDTH:
        return _text(x - 4, y, text, "axis", "end")
    return _text(x + 4, y, text, "axis")


def _tick_anchor(i: int) -> str:
    return "end" if i == 4 else "middle"


def _clip(text: str, n: int = 32) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def run_timeline(entries: Sequence[TimelineEntry], ops: Sequence[OperationRecord]) -> Markup:
    """The run's phases and operations on a time axis, with the cancel and the settle."""
    if not entries:
        return _svg(40, "timeline-svg", "no events", [_text(LABEL, 24, "no events yet")])
    start = entries[0].at
    span = max(entries[-1].at - start, 1e-3)

    def x(at: float) -> float:
        return LABEL + (at - start) / span * PLOT

    body: list[str] = []
    top = 10
    # the axis: five ticks, relative to the run's first event
    height = top + ROW * (1 + len(ops)) + 34
    for i in range(5):
        at = start + span * i / 4
        body.append(
            f'<line {_GRID} x1="{x(at):.1f}" y1="{top}" x2="{x(at):.1f}" y2="{height - 22}"/>'
        )
        label = f"+{fmt_seconds(at - start)}"
        body.append(_text(x(at), height - 8, label, "axis", _tick_anchor(i)))
    # phases: each from its event to the next phase (or the end)
    phases = [e for e in entries if e.kind == LogKind.PHASE]
    body.append(_text(8, top + 17, "phases"))
    for n, entry in enumerate(phases):
        end = phases[n + 1].at if n + 1 < len(phases) else entries[-1].at
        name = entry.detail.split(" ", 1)[0] or "phase"
        left, w = x(entry.at), max(x(end) - x(entry.at), 2.0)
        body.append(
            f'<rect fill="#d7e6f3" stroke="#8fb3d3" data-phase="{_esc(name)}" '
            f'x="{left:.1f}" y="{top + 4}" '
            f'width="{w:.1f}" height="{ROW - 8}"><title>{_esc(entry.detail)}</title></rect>'
        )
        body.append(_text(left + 4, top + 17, _clip(name, max(4, int(w / 7)))))
    # operations: a bar from the gate to the event that resolved it
    for row, op in enumerate(ops, start=1):
        y = top + ROW * row
        own = [e for e in entries if e.op_id == op.id]
        if not own:
            continue
        done = next(
            (e.at for e in own if e.transition.endswith(f"-> {op.status.value}")), entries[-1].at
        )
        if not op.status.resolved:
            done = entries[-1].at
        fill = _STATUS_FILL.get(op.status, "#e0a43a")
        body.append(_text(8, y + 17, _clip(op.description or op.tool)))
        body.append(
            f'<rect fill="{fill}" data-op="{_esc(op.id)}" data-status="{op.status.value}" '
            f'x="{x(own[0].at):.1f}" y="{y + 6}" width="{max(x(done) - x(own[0].at), 3.0):.1f}" '
            f'height="{ROW - 12}"><title>{_esc(op.description or op.tool)}: '
            f"{op.status.value}</title></rect>"
        )
        for e in own:
            body.append(
                f'<circle fill="#1d2329" cx="{x(e.at):.1f}" cy="{y + ROW / 2:.1f}" r="3">'
                f"<title>{_esc(e.words)}</title></circle>"
            )
    # the cancel and the settle, across every row
    for e in entries:
        mark = "cancel" if e.kind == RunEvent.CANCEL else _SETTLE_KINDS.get(e.kind)
        if mark is None:
            continue
        name = "cancel" if mark == "cancel" else "settled"
        body.append(_mark(name, x(e.at), top, height - 22, e.words))
        body.append(_beside(x(e.at), top + 9, mark, left=name == "cancel"))
    title = f"timeline: {len(phases)} phases, {len(ops)} operations over {fmt_seconds(span)}"
    return _svg(height, "timeline-svg", title, body)


def settle_chart(seconds: Sequence[float], p50: float | None, p99: float | None) -> Markup:
    """A histogram of cancel-to-settled times (up to 20 buckets), p50 and p99 marked."""
    height = 220
    if not seconds:
        text = _text(LABEL, 30, "no cancelled run has settled yet")
        return _svg(50, "settle-chart", "cancel to settled: no data", [text])
    top, bottom = 14, height - 30
    low, high = 0.0, max(max(seconds), 1e-3)
    buckets = min(20, max(1, len(seconds)))
    width = (high - low) / buckets
    counts = [0] * buckets
    for value in seconds:
        counts[min(int((value - low) / width), buckets - 1)] += 1
    tallest = max(counts)

    def x(value: float) -> float:
        return LABEL + (value - low) / (high - low) * PLOT

    body = [_text(8, top + 12, "runs per bucket"), _text(8, top + 28, f"({len(seconds)} runs)")]
    for i, count in enumerate(counts):
        if not count:
            continue
        h = count / tallest * (bottom - top)
        left = x(low + i * width)
        body.append(
            f'<rect fill="#7ea6c9" data-count="{count}" x="{left + 1:.1f}" y="{bottom - h:.1f}" '
            f'width="{max(PLOT / buckets - 2, 1):.1f}" height="{h:.1f}"><title>{count} runs '
            f"between {fmt_seconds(low + i * width)} and {fmt_seconds(low + (i + 1) * width)}"
            "</title></rect>"
        )
    for i in range(5):
        tick = low + (high - low) * i / 4
        body.append(_text(x(tick), height - 10, fmt_seconds(tick), "axis", _tick_anchor(i)))
    body.append(f'<line {_GRID} x1="{LABEL}" y1="{bottom}" x2="{LABEL + PLOT}" y2="{bottom}"/>')
    for name, mark in (("p50", p50), ("p99", p99)):
        if mark is None:
            continue
        value = mark
        body.append(_mark(name, x(value), top, bottom, f"{name} {fmt_seconds(value)}"))
        body.append(
            _beside(
                x(value), top + 10 + (12 if name == "p99" else 0), f"{name} {fmt_seconds(value)}"
            )
        )
    title = (
        f"cancel to settled: {len(seconds)} runs, p50 {fmt_seconds(p50)}, p99 {fmt_seconds(p99)}"
    )
    return _svg(height, "settle-chart", title, body)
