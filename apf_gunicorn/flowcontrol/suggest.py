"""The closest known name to a misspelt one, for "did you mean" hints.

Used for unknown fields of a configuration object (:mod:`.spec_decoding`, :mod:`.loader`) and for
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
