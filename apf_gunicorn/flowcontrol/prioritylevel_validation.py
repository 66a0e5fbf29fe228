"""kube-apiserver's validation rules for a PriorityLevelConfiguration, with Kubernetes' texts,
and the controller's runtime check of a valid one.

``ValidatePriorityLevelConfiguration`` of ``pkg/apis/flowcontrol/validation``, on a spec that
:mod:`.spec_decoding` normalized and the loader defaulted; every problem goes to the
:class:`~.validation.ErrorList` given. :func:`broken_reason` is the later check by which
Kubernetes' controller ignores a level that passed validation::

    validate_priority_level(name, spec, status, errs)
    why = broken_reason(name, spec)      # None: the level is usable
"""

from __future__ import annotations

from apf_gunicorn.flowcontrol.bootstrap import MANDATORY_PRIORITY_LEVEL_SPECS
from apf_gunicorn.flowcontrol.objects import (
    EXEMPT,
    RESPONSE_QUEUE,
    RESPONSE_REJECT,
    TYPE_EXEMPT,
    TYPE_LIMITED,
)
from apf_gunicorn.flowcontrol.shufflesharding import MAX_HASH_BITS, required_entropy_bits
from apf_gunicorn.flowcontrol.validation import ErrorList, validate_object_name, validate_status

MAX_QUEUES = 10 * 1000 * 1000
SUPPORTED_PL_TYPES = (TYPE_EXEMPT, TYPE_LIMITED)
SUPPORTED_LIMIT_RESPONSES = (RESPONSE_QUEUE, RESPONSE_REJECT)


def validate_priority_level(name: str, spec: dict, status: dict, errs: ErrorList) -> None:
    """``ValidatePriorityLevelConfiguration`` on a defaulted normalized spec."""
    validate_object_name(name, errs)
    _validate_priority_level_spec(name, spec, errs)
    mandatory = MANDATORY_PRIORITY_LEVEL_SPECS.get(name)
    if mandatory is not None:
        if name == EXEMPT:
            # Admins may tune the exempt level's spec.exempt (shares and lendable percent).
            if {**spec, "exempt": None} != {**mandatory, "exempt": None}:
                errs.invalid(
                    "spec",
                    spec,
                    "spec of 'exempt' except the 'spec.exempt' field must equal the fixed value",
                )
        elif spec != mandatory:
            errs.invalid("spec", spec, f"spec of '{name}' must equal the fixed value")
    validate_status(status, errs)


def _validate_priority_level_spec(name: str, spec: dict, errs: ErrorList) -> None:
    ptype = spec["type"]
    if (name == EXEMPT) != (ptype == TYPE_EXEMPT):
        errs.invalid("spec.type", ptype, "type must be 'Exempt' if and only if name is 'exempt'")
    if ptype == TYPE_EXEMPT:
        if spec["limited"] is not None:
            errs.forbidden("spec.limited", "must be nil if the type is not Limited")
        if spec["exempt"] is not None:
            _validate_shares_and_lendable(spec["exempt"], "spec.exempt", errs)
    elif ptype == TYPE_LIMITED:
        if spec["exempt"] is not None:
            errs.forbidden("spec.exempt", "must be nil if the type is Limited")
        if spec["limited"] is None:
            errs.required("spec.limited", "must not be empty when type is Limited")
        else:
            _validate_limited(spec["limited"], "spec.limited", errs)
    else:
        errs.not_supported("spec.type", ptype, SUPPORTED_PL_TYPES)


def _validate_shares_and_lendable(cfg: dict, path: str, errs: ErrorList) -> None:
    ncs = cfg["nominalConcurrencyShares"]
    if ncs is not None and ncs < 0:
        errs.invalid(f"{path}.nominalConcurrencyShares", ncs, "must be a non-negative integer")
    lendable = cfg["lendablePercent"]
    if lendable is not None and not 0 <= lendable <= 100:
        errs.invalid(f"{path}.lendablePercent", lendable, "must be between 0 and 100, inclusive")


def _validate_limited(limited: dict, path: str, errs: ErrorList) -> None:
    _validate_shares_and_lendable(limited, path, errs)
    borrowing = limited["borrowingLimitPercent"]
    if borrowing is not None and borrowing < 0:
        errs.invalid(
            f"{path}.borrowingLimitPercent",
            borrowing,
            "if specified, must be a non-negative integer",
        )
    lr = limited["limitResponse"]
    lr_path = f"{path}.limitResponse"
    if lr["type"] == RESPONSE_REJECT:
        if lr["queuing"] is not None:
            errs.forbidden(
                f"{lr_path}.queuing", "must be nil if limited.limitResponse.type is not Limited"
            )
    elif lr["type"] == RESPONSE_QUEUE:
        if lr["queuing"] is None:
            errs.required(
                f"{lr_path}.queuing", "must not be empty if limited.limitResponse.type is Limited"
            )
        else:
            _validate_queuing(lr["queuing"], f"{lr_path}.queuing", errs)
    else:
        errs.not_supported(f"{lr_path}.type", lr["type"], SUPPORTED_LIMIT_RESPONSES)


def _validate_queuing(q: dict, path: str, errs: ErrorList) -> None:
    qll, queues, hand = q["queueLengthLimit"], q["queues"], q["handSize"]
    if qll <= 0:
        errs.invalid(f"{path}.queueLengthLimit", qll, "must be positive")
    if queues <= 0:
        errs.invalid(f"{path}.queues", queues, "must be positive")
    elif queues > MAX_QUEUES:
        errs.invalid(f"{path}.queues", queues, f"must not be greater than {MAX_QUEUES}")
    if hand <= 0:
        errs.invalid(f"{path}.handSize", hand, "must be positive")
    elif hand > queues:
        errs.invalid(f"{path}.handSize", hand, f"should not be greater than queues ({queues})")
    elif required_entropy_bits(queues, hand) > MAX_HASH_BITS:
        errs.invalid(
            f"{path}.handSize",
            hand,
            f"required entropy bits of deckSize {queues} and handSize {hand} "
            f"should not be greater than {MAX_HASH_BITS}",
        )


# --------------------------------------------------------------------------------------------
# Runtime sanity check (apf_controller.go queueSetCompleterForPL)


def broken_reason(name: str, spec: dict) -> str | None:
    """Why the controller would ignore this (valid) priority level as broken, or None."""
    ptype = spec["type"]
    if (ptype == TYPE_LIMITED) != (spec["limited"] is not None):
        return "broken union structure at the top, for Limited"
    if (ptype == TYPE_EXEMPT) != (spec["exempt"] is not None):
        return "broken union structure at the top, for Exempt"
    if (ptype == TYPE_EXEMPT) != (name == EXEMPT):
        return "non-alignment between name and type"
    limited = spec["limited"]
    if limited is not None:
        lr = limited["limitResponse"]
        if (lr["type"] == RESPONSE_REJECT) != (lr["queuing"] is None):
            return "broken union structure for limit response"
        q = lr["queuing"]
        if q is not None and q["queues"] > 0:
            hand, queues = q["handSize"], q["queues"]
            if hand <= 0 or hand > queues or queues > 1 << 26:
                return f"bad queuing config: queues {queues}, handSize {hand}"
            if required_entropy_bits(queues, hand) > MAX_HASH_BITS:
                return f"bad queuing config: queues {queues}, handSize {hand}"
    return None
