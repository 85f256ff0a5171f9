"""Stage 1 — the naive contiguous KV cache, one lesson step per test, in order.

Run: pytest stages -m stage1 (add --impl PKG to grade your own package).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedref.attention import attention
from pagedref.course import lesson, raises

contig = lesson("pagedref.memory.contiguous")

NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 2, 8, 4


def make_kv(rng: np.random.Generator, n: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """K and V of n new tokens: [n, num_kv_heads, head_dim] each."""
    shape = (n, NUM_KV_HEADS, HEAD_DIM)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def test_step1_admit_reserves_max_model_len_contiguous_slots_first_fit():
    cache = contig.ContiguousKVCache(num_slots=100, max_model_len=30)
    assert cache.admit(0) == 0, "stage 1: the first reservation must start at slot 0 (first fit over an empty arena)"
    assert cache.admit(1) == 30, "stage 1: admit() must reserve max_model_len slots, so the next request starts at 30"
    assert cache.admit(2, max_len=10) == 60, "stage 1: admit(max_len=...) reserves the next hole that fits"
    assert cache.holes() == [(70, 30)], "stage 1: holes() must list the free stretches (start, length) in address order"
    assert cache.reservations[1] == contig.Reservation(start=30, capacity=30, num_tokens=0), \
        "stage 1: cache.reservations maps each admitted request id to its Reservation(start, capacity, num_tokens)"
    assert cache.admit(3, max_len=1) == 70, "stage 1: the smallest reservation, 1 slot, is a valid one"
    tiny = contig.ContiguousKVCache(num_slots=1, max_model_len=1)
    assert tiny.admit(0) == 0 and tiny.holes() == [], "stage 1: an arena of 1 slot holds one request of 1; a full arena has no hole"


def test_step2_appended_tokens_sit_in_consecutive_slots_and_read_back_exactly():
    rng = np.random.default_rng(0)
    cache = contig.ContiguousKVCache(num_slots=64, max_model_len=32, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    cache.admit(0)
    cache.admit(1)
    k0, v0 = make_kv(rng, 5)
    k1, v1 = make_kv(rng, 3)
    assert list(cache.append(0, k0, v0)) == [0, 1, 2, 3, 4], "stage 1: a prefill's tokens take consecutive slots from the reservation's start"
    assert list(cache.append(1, k1, v1)) == [32, 33, 34], "stage 1: request 1's tokens go into its own reservation"
    kd, vd = make_kv(rng, 1)
    assert list(cache.append(0, kd, vd)) == [5], "stage 1: a decode token takes the next slot after the request's last token"
    k, v = cache.read(0)
    assert k.tobytes() == np.concatenate([k0, kd]).tobytes(), "stage 1: read() must return exactly the K that were appended, in order"
    assert v.tobytes() == np.concatenate([v0, vd]).tobytes(), "stage 1: read() must return exactly the V that were appended, in order"
    assert cache.append(1, num_tokens=2) == range(35, 37), "stage 1: append(num_tokens=n) reserves slots without storing K/V"
    assert cache.append(1, num_tokens=0) == range(37, 37), "stage 1: appending 0 tokens is allowed and takes no slot"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_step3_attention_read_from_the_cache_equals_the_oracle_bit_for_bit(dtype):
    rng = np.random.default_rng(1)
    cache = contig.ContiguousKVCache(num_slots=96, max_model_len=40, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)
    ks, vs = {}, {}
    for rid in (0, 1):  # two requests, so request 1 lives away from slot 0
        cache.admit(rid)
        ks[rid], vs[rid] = make_kv(rng, 7, dtype)
        cache.append(rid, ks[rid], vs[rid])
        q = rng.standard_normal((7, NUM_HEADS, HEAD_DIM)).astype(dtype)
        out = cache.attention(rid, q)
        assert out.tobytes() == attention(q, ks[rid], vs[rid]).tobytes(), \
            f"stage 1: prefill attention of request {rid} must equal the oracle exactly ({np.dtype(dtype).name})"
    for _ in range(5):  # decode steps, interleaved between the two requests
        for rid in (0, 1):
            k, v = make_kv(rng, 1, dtype)
            ks[rid], vs[rid] = np.concatenate([ks[rid], k]), np.concatenate([vs[rid], v])
            cache.append(rid, k, v)
            q = rng.standard_normal((1, NUM_HEADS, HEAD_DIM)).astype(dtype)
            assert cache.attention(rid, q, scale=0.3).tobytes() == attention(q, ks[rid], vs[rid], scale=0.3).tobytes(), \
                f"stage 1: decode attention of request {rid} must equal the oracle exactly ({np.dtype(dtype).name})"


def test_step4_a_request_cannot_grow_past_its_reservation():
    cache = contig.ContiguousKVCache(num_slots=64, max_model_len=16)
    cache.admit(0, max_len=4)
    cache.append(0, num_tokens=4)
    with raises(contig.MaxModelLenError, "stage 1: append past the reservation must raise MaxModelLenError"):
        cache.append(0, num_tokens=1)
    with raises(contig.MaxModelLenError, "stage 1: admit must refuse a max_len larger than max_model_len with MaxModelLenError"):
        cache.admit(1, max_len=17)
    assert 1 not in cache.reservations, "stage 1: a refused admit must hold no reservation"
    assert cache.reservations[0].num_tokens == 4, "stage 1: a refused append must leave the request unchanged"


def test_step5_release_leaves_a_hole_and_first_fit_takes_the_lowest_hole_that_fits():
    cache = contig.ContiguousKVCache(num_slots=100, max_model_len=30)
    for rid in range(3):
        cache.admit(rid)
    cache.release(1)
    assert cache.holes() == [(30, 30), (90, 10)], "stage 1: release() must return the request's whole stretch as a hole"
    assert (cache.find_hole(10), cache.find_hole(30), cache.find_hole(31)) == (30, 30, None), \
        "stage 1: find_hole(size) is first fit: the start of the lowest hole of at least size slots, or None"
    assert cache.admit(3, max_len=10) == 30, "stage 1: first fit picks the lowest-addressed hole that is large enough"
    assert cache.admit(4, max_len=20) == 40, "stage 1: the rest of a partly used hole is still a hole"
    assert cache.admit(5, max_len=10) == 90, "stage 1: a request that fits only the last hole goes there"


def test_step6_external_fragmentation_refuses_a_request_although_enough_memory_is_free():
    cache = contig.ContiguousKVCache(num_slots=10, max_model_len=10)
    cache.admit(0, max_len=3)  # slots 0..2
    cache.admit(1, max_len=4)  # slots 3..6
    cache.admit(2, max_len=3)  # slots 7..9
    cache.release(0)
    cache.release(2)
    assert sum(length for _, length in cache.holes()) == 6, "stage 1: 6 slots are free in total"
    with raises(contig.NoContiguousSpaceError, "stage 1: no single hole holds 4 slots, so admit must raise NoContiguousSpaceError"):
        cache.admit(3, max_len=4)
    assert 3 not in cache.reservations, "stage 1: a refused request must hold no reservation"


def test_step7_usage_splits_the_arena_into_token_states_reserved_and_fragmentation():
    cache = contig.ContiguousKVCache(num_slots=100, max_model_len=30)
    for rid, n in enumerate((5, 10, 2)):
        cache.admit(rid)
        cache.append(rid, num_tokens=n)
    u = cache.usage({0: 20, 1: 10, 2: 25})  # the requests' final lengths, known only to an observer
    assert u.total == 100, "stage 1: total is every slot of the arena"
    assert u.token_states == 17, "stage 1: token states are the slots holding tokens already processed (5 + 10 + 2)"
    assert u.reserved == 15 + 0 + 23, "stage 1: reserved slots will hold tokens generated later (final length - tokens so far)"
    assert u.internal_fragmentation == 10 + 20 + 5, "stage 1: internal fragmentation = reservation - final length, never used"
    assert u.external_fragmentation == 10, "stage 1: the 10-slot hole cannot hold a max_model_len (30) reservation: external fragmentation"
    assert u.token_states + u.reserved + u.internal_fragmentation + u.external_fragmentation == u.total, \
        "stage 1: the four parts must add up to the whole arena when no usable hole is left"
    assert u.token_state_fraction == 17 / 100, "stage 1: token_state_fraction is token states / occupied memory"
    blind = cache.usage()
    assert (blind.reserved, blind.internal_fragmentation) == (90 - 17, 0), \
        "stage 1: without final lengths, every unused reserved slot counts as reserved"


def test_step8_a_hole_that_still_fits_a_request_is_free_memory_not_fragmentation():
    cache = contig.ContiguousKVCache(num_slots=100, max_model_len=30)
    for rid, n in enumerate((6, 4)):  # slots 0..59 reserved; the 40-slot tail can take another request
        cache.admit(rid)
        cache.append(rid, num_tokens=n)
    cache.admit(2, max_len=10)  # slots 60..69: the tail shrinks to 30 slots, exactly max_model_len: still usable
    u = cache.usage({0: 6, 1: 30, 2: 5})
    assert u.external_fragmentation == 0, \
        "stage 1: external fragmentation counts only holes shorter than max_model_len; the 30-slot hole still fits a request"
    assert u.free == 30 and u.occupied == 70, "stage 1: a usable hole is free memory, outside the occupied part"
    assert u.token_state_fraction == 10 / 70, \
        "stage 1: token_state_fraction is token states / occupied memory (not / total: usable free memory is not waste)"
    cache.admit(3, max_len=25)  # slots 70..94: the 5-slot tail is too small for any max_model_len request
    u = cache.usage()
    assert u.external_fragmentation == 5 and u.free == 5, \
        "stage 1: the 5-slot tail is external fragmentation: shorter than max_model_len, and still free memory"
    assert u.occupied == 100 and u.token_state_fraction == 10 / 100, \
        "stage 1: with no usable hole left, occupied memory is the whole arena"
    assert u.fraction(u.reserved) == u.reserved / 100, "stage 1: fraction(part) is part / occupied memory"
    assert contig.ContiguousKVCache(num_slots=50, max_model_len=10).usage().fraction(0) == 0.0, \
        "stage 1: with nothing occupied, every fraction is 0.0 (not a division by zero)"


def test_step9_bad_input_gets_a_clear_error():
    with raises(ValueError, "stage 1: num_slots < 1 must raise ValueError naming num_slots", match="num_slots"):
        contig.ContiguousKVCache(num_slots=0, max_model_len=8)
    with raises(ValueError, "stage 1: max_model_len < 1 must raise ValueError naming max_model_len", match="max_model_len"):
        contig.ContiguousKVCache(num_slots=8, max_model_len=0)
    cache = contig.ContiguousKVCache(num_slots=16, max_model_len=8)
    cache.admit(0)
    with raises(ValueError, "stage 1: admitting a request twice must raise ValueError (\"already admitted\")",
                match="already admitted"):
        cache.admit(0)
    cache.release(0)
    with raises(KeyError, "stage 1: releasing twice must raise KeyError (\"no reservation\"), not be a silent no-op",
                match="no reservation"):
        cache.release(0)
    with raises(KeyError, "stage 1: append for a request never admitted must raise KeyError (\"no reservation\")",
                match="no reservation"):
        cache.append(7, num_tokens=1)
    cache.admit(1)
    with raises(ValueError, "stage 1: append with a negative num_tokens must raise ValueError naming num_tokens",
                match="num_tokens"):
        cache.append(1, num_tokens=-1)
    assert cache.reservations[1].num_tokens == 0, "stage 1: a refused append must leave the request unchanged"
    with raises(ValueError, "stage 1: read() on a cache built without storage must raise ValueError (\"storage\")",
                match="storage"):
        cache.read(1)  # built without num_kv_heads/head_dim: there is nothing to read
    half = contig.ContiguousKVCache(num_slots=8, max_model_len=4, num_kv_heads=2)  # head_dim 0: still no storage
    half.admit(0)
    with raises(ValueError, "stage 1: storage needs both num_kv_heads and head_dim; without it read() raises ValueError",
                match="storage"):
        half.read(0)
    assert contig.ContiguousKVCache(num_slots=1, max_model_len=1).num_slots == 1, "stage 1: 1 slot and max_model_len 1 are valid"
