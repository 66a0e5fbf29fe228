"""Which fairness each priority level runs, and where that choice comes from.

A queuing priority level picks the next request to dispatch by one of two fairnesses:

* ``kubernetes``: Kubernetes' queueset (fair queuing by virtual finish time over
  shuffle-sharded queues), exactly as kube-apiserver;
* ``maxmin``: max-min fair dispatch between flows, work-conserving behind wide requests
  (docs/fairness.md).

The choice, per level, most specific first:

1. the level's annotation ``apf-gunicorn.io/fairness: maxmin|kubernetes`` (a
   PriorityLevelConfiguration stays valid Kubernetes YAML; validated by the loader);
2. the server's ``APF_FAIRNESS`` (or the simulator's ``--fairness`` / ``queueSet.fairness``);
3. the server runs ``maxmin`` (:data:`SERVER_DEFAULT`); a simulator scenario runs ``kubernetes``
   (:data:`SCENARIO_DEFAULT`: Kubernetes' harness scenarios leave the field out and stay exact).

Exempt levels never queue and have no fairness (:func:`level_fairness` returns None); the loader
refuses the annotation on them.

    name, source = level_fairness(pl, settings.fairness, "APF_FAIRNESS")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apf_gunicorn.flowcontrol.limits import MAX_SEATS_ANNOTATION

if TYPE_CHECKING:
    from apf_gunicorn.flowcontrol.objects import PriorityLevel

KUBERNETES = "kubernetes"
MAXMIN = "maxmin"
#: Every fairness a setting, an annotation or a scenario may ask for.
NAMES = (KUBERNETES, MAXMIN)
#: What the server runs where neither APF_FAIRNESS nor an annotation asks for a fairness.
SERVER_DEFAULT = MAXMIN
#: What a simulator scenario runs without ``fairness:`` (Kubernetes' own harness scenarios,
#: which must stay exact).
SCENARIO_DEFAULT = KUBERNETES
#: The PriorityLevelConfiguration annotation that chooses the level's fairness.
ANNOTATION = "apf-gunicorn.io/fairness"
#: Annotation keys of our own prefix that the loader knows (any other one is a typo).
ANNOTATION_PREFIX = "apf-gunicorn.io/"
KNOWN_ANNOTATIONS = (ANNOTATION, MAX_SEATS_ANNOTATION)


def level_fairness(level: PriorityLevel, default: str,
                   default_source: str = "default") -> tuple[str | None, str]:
    """The fairness a priority level runs, and where the choice came from.

    Args:
        level: the priority level (its ``fairness`` is the annotation's value, or None).
        default: the fairness of levels without the annotation (``APF_FAIRNESS``, the
            simulator's ``--fairness``), one of :data:`NAMES`.
        default_source: how to name where ``default`` came from (``"APF_FAIRNESS"``).

    Returns:
        ``(fairness, source)``: ``(None, "exempt")`` for an exempt level (never queued),
        ``(level.fairness, "annotation apf-gunicorn.io/fairness")`` when annotated, else
        ``(default, default_source)``.
    """
    if level.is_exempt:
        return None, "exempt"
    if level.fairness is not None:
        return level.fairness, f"annotation {ANNOTATION}"
    return default, default_source
