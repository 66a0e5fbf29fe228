"""Shuffle sharding and flow hashing, exactly as Kubernetes does them.

A flow is identified by ``flow_hash(flow_schema_name, distinguisher)`` (first 8 bytes of
SHA-256, little-endian). A :class:`Dealer` turns that hash into a *hand* of distinct queue
indices; the queue set then picks the least-loaded queue in the hand.

    >>> Dealer(9, 3).deal(1001001001)
    (4, 6, 0)
    >>> flow_hash("catch-all", "")
    7733929212674924205
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache

MAX_HASH_BITS = 60
MAX_DECK_SIZE = 1 << 26
_U64 = (1 << 64) - 1


class DealerError(ValueError):
    """A deck/hand combination Kubernetes refuses, with Kubernetes' message."""


def required_entropy_bits(deck_size: int, hand_size: int) -> int:
    return math.ceil(math.log2(deck_size) * hand_size)


def check_dealer(deck_size: int, hand_size: int) -> None:
    """Raise :class:`DealerError` with Kubernetes' text when ``NewDealer`` would fail."""
    if deck_size <= 0 or hand_size <= 0:
        raise DealerError(f"deckSize {deck_size} or handSize {hand_size} is not positive")
    if hand_size > deck_size:
        raise DealerError(f"handSize {hand_size} is greater than deckSize {deck_size}")
    if deck_size > MAX_DECK_SIZE:
        raise DealerError(f"deckSize {deck_size} is impractically large")
    if required_entropy_bits(deck_size, hand_size) > MAX_HASH_BITS:
        raise DealerError(
            f"required entropy bits of deckSize {deck_size} and handSize {hand_size} "
            f"is greater than {MAX_HASH_BITS}"
        )


class Dealer:
    """Deals hands of ``hand_size`` distinct cards from a deck of ``deck_size``."""

    __slots__ = ("deck_size", "hand_size")

    def __init__(self, deck_size: int, hand_size: int) -> None:
        check_dealer(deck_size, hand_size)
        self.deck_size = deck_size
        self.hand_size = hand_size

    def deal(self, hash_value: int) -> tuple[int, ...]:
        return deal(hash_value, self.deck_size, self.hand_size)


@lru_cache(maxsize=65536)
def deal(hash_value: int, deck_size: int, hand_size: int) -> tuple[int, ...]:
    """The hand for ``hash_value`` (uint64). Cached: flows repeat, and the deal is pure."""
    h = hash_value & _U64
    remainders = []
    for i in range(hand_size):
        d = deck_size - i
        remainders.append(h % d)
        h //= d
    hand = []
    for i in range(hand_size):
        card = remainders[i]
        for j in range(i, 0, -1):
            if card >= remainders[j - 1]:
                card += 1
        hand.append(card)
    return tuple(hand)


def flow_hash(flow_schema_name: str, distinguisher: str) -> int:
    """Kubernetes ``hashFlowID``: SHA-256 of name, a zero byte and the distinguisher; the
    first 8 digest bytes read as a little-endian uint64."""
    digest = hashlib.sha256(
        flow_schema_name.encode("utf-8", "surrogateescape")
        + b"\0"
        + distinguisher.encode("utf-8", "surrogateescape")
    ).digest()
    return int.from_bytes(digest[:8], "little")
