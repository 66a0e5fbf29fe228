"""The closest known name to a misspelt one, for "did you mean" hints.

Used for unknown fields of a configuration object (:mod:`.spec_decoding`, :mod:`.loader`), unknown
keys of an ``APF_ROUTES`` entry (:mod:`.routes`) or of a work estimate (:mod:`.workestimate`), and
unknown ``APF_*`` variables (:mod:`apf_gunicorn.server.startup`)::

    closest("queueLenghtLimit", ["queues", "handSize", "queueLengthLimit"])
    # -> "queueLengthLimit"
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

#: How alike two names must be (difflib's ratio) for one to be suggested for the other.
CUTOFF = 0.6


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name most like ``name`` (difflib's ratio at least :data:`CUTOFF`), or None."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=CUTOFF)
    return found[0] if found else None


def unknown_field(name: str, known: Iterable[str]) -> str:
    """The error detail for an unknown field: ``"unknown field; did you mean spec?"``, or
    ``"unknown field"`` when no known field is close."""
    match = closest(name, known)
    return "unknown field" if match is None else f"unknown field; did you mean {match}?"


def unknown_keys(unknown: Iterable[object], known: Iterable[str], what: str = "") -> str:
    """The error detail for unknown keys of a mapping, each with its closest known key.

    Args:
        unknown: the keys not allowed (any objects: YAML keys need not be strings).
        known: the allowed keys.
        what: words before "key(s)", e.g. ``"work estimate "``.
    Returns:
        ``"unknown key(s) ['verb']; did you mean verbs?; allowed: [...]"`` (with several close
        ones ``"did you mean seats for seat, verbs for verb?"``; no hint when none is close).
    """
    known = sorted(known)
    names = sorted(map(str, unknown))
    hints = [(name, match) for name in names if (match := closest(name, known)) is not None]
    text = f"unknown {what}key(s) {names}"
    if len(hints) == 1 and len(names) == 1:
        text += f"; did you mean {hints[0][1]}?"
    elif hints:
        text += "; did you mean " + ", ".join(f"{m} for {n}" for n, m in hints) + "?"
    return f"{text}; allowed: {known}"
