"""apf_gunicorn's own annotations of a configuration object (``apf-gunicorn.io/...``).

A PriorityLevelConfiguration may choose its fairness (``apf-gunicorn.io/fairness``) and its
widest request (``apf-gunicorn.io/max-seats``) in ``metadata.annotations``; this checks them,
with every problem in the :class:`~.validation.ErrorList` given, and says what they ask for::

    ours = validate_annotations(annotations, kind, spec, errs)
    ours.fairness, ours.max_seats        # None: not set (or set badly, which is in errs)

Other annotations are ignored, as Kubernetes ignores them.
"""

from __future__ import annotations

from typing import NamedTuple

from apf_gunicorn.flowcontrol.fairness import (
    ANNOTATION,
    ANNOTATION_PREFIX,
    KNOWN_ANNOTATIONS,
    NAMES,
)
from apf_gunicorn.flowcontrol.objects import KIND_PRIORITY_LEVEL, TYPE_EXEMPT
from apf_gunicorn.flowcontrol.validation import ErrorList


class Annotations(NamedTuple):
    """What apf_gunicorn's own annotations of an object ask for (None: nothing)."""

    fairness: str | None = None  # apf-gunicorn.io/fairness: the level's fairness
    max_seats: int | None = None  # apf-gunicorn.io/max-seats: the level's widest request


def validate_annotations(annotations: dict, kind: str, spec: dict,
                         errs: ErrorList) -> Annotations:
    """Check the ``apf-gunicorn.io/`` annotations of an object; other annotations are ignored
    as Kubernetes ignores them.

    Args:
        annotations: ``metadata.annotations`` (a dict).
        kind: ``FlowSchema`` or ``PriorityLevelConfiguration``.
        spec: the object's normalized spec (a priority level's ``type`` decides whether it may
            choose a fairness or a max seats).
        errs: where problems go, each on the field ``metadata.annotations[KEY]``.

    Returns:
        The fairness a PriorityLevelConfiguration's ``apf-gunicorn.io/fairness`` names and the
        seats its ``apf-gunicorn.io/max-seats`` gives; None for what it does not set (or sets
        badly, which is in ``errs``).
    """
    fairness = max_seats = None
    for key, value in annotations.items():
        if not isinstance(key, str) or not key.startswith(ANNOTATION_PREFIX):
            continue
        path = f"metadata.annotations[{key}]"
        if key not in KNOWN_ANNOTATIONS:
            errs.add(path, f"unknown annotation (known: {', '.join(KNOWN_ANNOTATIONS)})")
            continue
        what = ("fairness" if key == ANNOTATION
                else "the widest request (max seats)")
        if kind != KIND_PRIORITY_LEVEL:
            errs.forbidden(path, f"{what} is chosen per priority level: annotate the "
                                 "PriorityLevelConfiguration")
        elif not isinstance(value, str):
            errs.invalid(path, value, "must be a string")
        elif spec["type"] == TYPE_EXEMPT:
            errs.forbidden(path, "an exempt priority level never queues, so it has no "
                                 + ("fairness" if key == ANNOTATION else "max seats"))
        elif key == ANNOTATION:
            if value not in NAMES:
                errs.not_supported(path, value, NAMES)
            else:
                fairness = value
        else:
            seats = _positive_int(value)
            if seats is None:
                errs.invalid(path, value, f"must be a positive integer of seats, at most "
                                          f"{MAX_ANNOTATED_SEATS} (e.g. \"4\")")
            else:
                max_seats = seats
    return Annotations(fairness, max_seats)


#: Largest ``apf-gunicorn.io/max-seats`` accepted (the server's limit is at most 1000000).
MAX_ANNOTATED_SEATS = 1_000_000


def _positive_int(text: str) -> int | None:
    text = text.strip()
    if not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if 1 <= value <= MAX_ANNOTATED_SEATS else None
