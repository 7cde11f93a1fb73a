"""Stored text as the console shows it: reading as stored (ADR 0070).

A run's name, an operation's description, a reason, an error or a piece of evidence
may hold Unicode's bidirectional controls (U+202E RIGHT-TO-LEFT OVERRIDE, the
isolates U+2066-U+2069, the marks U+200E/U+200F, ...). Shown as they are, they
reorder what a reader sees (``refund \\u202e0001\\u202c EUR`` reads as 1000 EUR),
and right-to-left text in one value can pull its neighbour's digits across it (a
run named in Hebrew moves the first digit of the id beside it).

``shown``: a value in a page's text, in a ``<bdi>`` of its own (its direction
from its own first strong character, affecting nothing around it), each control
drawn by name (``<U+202E>``), marked. ``visible``: the same names as plain text,
for where no element can stand (an attribute, a ``<title>``, an SVG label); the
templates' ``finalize`` applies it to every other value, so a value left without
``shown`` still reads as stored.
"""

from __future__ import annotations

import unicodedata

from markupsafe import Markup, escape

from stopline.domain.limits import BIDI_CONTROLS, bidi_name, with_bidi_shown

__all__ = ["BIDI_CONTROLS", "finalize", "shown", "visible"]


def visible(text: str) -> str:
    """``text`` with each bidirectional control replaced by its code point, ``<U+202E>``
    (``limits.with_bidi_shown``, the CLI's rule too)."""
    return with_bidi_shown(text)


def shown(value: object) -> Markup:
    """``value`` (as ``str``) escaped, isolated in a ``<bdi>``, its bidirectional
    controls drawn by name in a ``<span class="ctl">`` titled with the character's name."""
    text = str(value)
    parts = [Markup("<bdi>")]
    last = 0
    for match in BIDI_CONTROLS.finditer(text):
        char = match[0]
        parts.append(escape(text[last : match.start()]))
        title = unicodedata.name(char, "bidirectional control")
        parts.append(
            Markup('<span class="ctl" title="{}">{}</span>').format(title.lower(), bidi_name(char))
        )
        last = match.end()
    parts.append(escape(text[last:]))
    parts.append(Markup("</bdi>"))
    return Markup("").join(parts)


def finalize(value: object) -> object:
    """Jinja's ``finalize``: every value a template prints that is not markup already
    (``shown``'s, a picture's) has its bidirectional controls made ``visible``."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return visible(value)
    return value
