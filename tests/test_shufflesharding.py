"""Shuffle sharding and flow hashing against Kubernetes' shufflesharding_test.go and the vectors
in reference/k8s-queueset.md §2.1 and §8.4."""

from __future__ import annotations

import math
import random
from collections import Counter
from itertools import permutations

import pytest

from apf_gunicorn.flowcontrol.shufflesharding import (
    Dealer,
    DealerError,
    check_dealer,
    deal,
    flow_hash,
    required_entropy_bits,
)

raw_deal = deal.__wrapped__  # bulk loops below must not churn the shared cache


@pytest.mark.parametrize("fs, distinguisher, expected", [
    ("catch-all", "", 7733929212674924205),
    ("global-default", "alice", 17644606172554983095),
    ("workload-low", "system:serviceaccount:default:foo", 9568163314297942207),
    ("service-accounts", "kube-system", 4467590379269162614),
])
def test_flow_hash_vectors(fs, distinguisher, expected):
    assert flow_hash(fs, distinguisher) == expected


def test_flow_hash_separates_name_and_distinguisher():
    assert flow_hash("ab", "c") != flow_hash("a", "bc")


@pytest.mark.parametrize("deck, hand, bits", [(1024, 6, 60), (512, 8, 72)])
def test_required_entropy_bits(deck, hand, bits):
    assert required_entropy_bits(deck, hand) == bits


@pytest.mark.parametrize("deck, hand, message", [
    (-100, 8, "deckSize -100 or handSize 8 is not positive"),
    (100, 0, "deckSize 100 or handSize 0 is not positive"),
    (100, 101, "handSize 101 is greater than deckSize 100"),
    (1 << 27, 2, "deckSize 134217728 is impractically large"),
    (512, 8, "required entropy bits of deckSize 512 and handSize 8 is greater than 60"),
])
def test_new_dealer_errors(deck, hand, message):
    with pytest.raises(DealerError) as err:
        Dealer(deck, hand)
    assert str(err.value) == message
    with pytest.raises(DealerError):
        check_dealer(deck, hand)


def test_new_dealer_ok():
    assert Dealer(1024, 6).deal(0) == (0, 1, 2, 3, 4, 5)


@pytest.mark.parametrize("deck, hand, hash_value, expected", [
    (9, 3, 1001001001, (4, 6, 0)),
    (9, 3, 2002002002, (8, 2, 1)),
    (9, 1, 1001001001, (4,)),
    (9, 1, 2002002002, (8,)),
    (8, 3, 400900100100, (4, 7, 5)),
    (8, 3, 300900200200, (0, 6, 1)),
    (64, 7, 10010010010010, (26, 34, 49, 6, 39, 27, 12)),
    (64, 7, 20020020020020, (52, 3, 34, 14, 13, 56, 25)),
    (64, 7, 40040040040040, (40, 7, 4, 29, 26, 48, 51)),
    (64, 7, 50050050050050, (2, 42, 53, 34, 0, 12, 63)),
    (64, 7, 60060060060060, (28, 11, 39, 43, 38, 37, 10)),
    (64, 7, 70070070070070, (54, 44, 22, 49, 12, 2, 25)),
    (64, 7, 90090090090090, (42, 49, 57, 63, 24, 56, 46)),
    (11, 1, 1, (1,)),
    (11, 1, 2, (2,)),
    (6, 6, 0, (0, 1, 2, 3, 4, 5)),
])
def test_deal_vectors(deck, hand, hash_value, expected):
    assert Dealer(deck, hand).deal(hash_value) == expected


def test_deal_sequences():
    assert [raw_deal(h, 4, 2) for h in range(12)] == [
        (0, 1), (1, 0), (2, 0), (3, 0), (0, 2), (1, 2), (2, 1), (3, 1), (0, 3), (1, 3), (2, 3),
        (3, 2)]
    assert [raw_deal(h, 6, 3) for h in range(12)] == [
        (0, 1, 2), (1, 0, 2), (2, 0, 1), (3, 0, 1), (4, 0, 1), (5, 0, 1), (0, 2, 1), (1, 2, 0),
        (2, 1, 0), (3, 1, 0), (4, 1, 0), (5, 1, 0)]


def test_deal_uses_only_the_low_64_bits():
    assert deal((1 << 64) + 1001001001, 9, 3) == (4, 6, 0)


@pytest.mark.parametrize("deck, hand", [(4, 4), (8, 8), (10, 10), (12, 12), (128, 8), (256, 7),
                                        (512, 6)])
def test_card_duplication(deck, hand):
    rng = random.Random(deck * 1000 + hand)
    for _ in range(200):
        cards = Dealer(deck, hand).deal(rng.getrandbits(64))
        assert len(cards) == hand
        assert len(set(cards)) == hand
        assert all(0 <= c < deck for c in cards)


@pytest.mark.parametrize("deck", range(1, 8))
def test_deal_is_a_bijection_onto_ordered_hands(deck):
    for hand in range(1, deck + 1):
        p = math.perm(deck, hand)
        dealt = {raw_deal(h, deck, hand) for h in range(p)}
        assert dealt == set(permutations(range(deck), hand))
        # and the hand depends only on hash mod P
        assert raw_deal(p + 3, deck, hand) == raw_deal(3, deck, hand)


def _check_uniform(deck: int, hand: int, hash_max: int) -> None:
    counts = Counter(tuple(sorted(raw_deal(h, deck, hand))) for h in range(hash_max))
    p = math.perm(deck, hand)
    low = math.factorial(hand) * (hash_max // p)
    high = math.factorial(hand) * -(-hash_max // p)
    assert all(low <= n <= high for n in counts.values()), (low, high, min(counts.values()),
                                                            max(counts.values()))


def test_uniform_distribution_small():
    # The shape of Kubernetes' 64/3 case, small enough to run every time: hashMax is a power of
    # two with 4 extra bits, not a multiple of P(12, 3) = 1320.
    p = math.perm(12, 3)
    _check_uniform(12, 3, 1 << (math.ceil(math.log2(p)) + 4))
    _check_uniform(9, 3, math.perm(9, 3) * 4)


@pytest.mark.slow
@pytest.mark.parametrize("deck, hand, hash_max", [
    (64, 3, 1 << (math.ceil(math.log2(math.perm(64, 3))) + (64 - 60))),
    (128, 3, math.perm(128, 3)),
    (50, 4, math.perm(50, 4)),
])
def test_uniform_distribution_kubernetes(deck, hand, hash_max):
    _check_uniform(deck, hand, hash_max)
