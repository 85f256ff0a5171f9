"""Stage 1 — the naive contiguous KV cache: the wasteful baseline PagedAttention replaces.

One idea: as in serving systems before vLLM, each request reserves one contiguous stretch of the KV
arena big enough for its *maximum* length (max_model_len by default) the moment it is admitted,
because its final length is unknown. First fit over a linear arena picks the stretch.

Where the memory goes (Fig. 2 of Kwon et al., SOSP 2023), in token slots:
- token states: slots holding K/V of tokens already processed;
- reserved: slots reserved for tokens the request *will* produce later (held idle until then);
- internal fragmentation: slots reserved past the request's final length — never used at all;
- external fragmentation: free holes too small for the next reservation (max_model_len slots), so a
  request can be refused even when enough memory is free in total.

Invariant: reservations never overlap, token_states + reserved + internal + free == total, and the
K/V a request appended are read back contiguously, so attention equals the oracle bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from pagedref.attention import attention
from pagedref.memory.block_table import MaxModelLenError


class NoContiguousSpaceError(Exception):
    """No free hole is large enough for the reservation (even if enough memory is free in total)."""


@dataclass
class Reservation:
    start: int  # first slot of the stretch
    capacity: int  # slots reserved (the request's maximum length)
    num_tokens: int = 0  # slots holding token states


@dataclass
class MemoryUsage:
    """KV memory by purpose, in token slots (the same accounting for the contiguous and paged caches)."""

    total: int  # every slot of the arena
    token_states: int  # slots holding K/V of tokens already processed
    reserved: int  # reserved slots the request will still fill (up to its final length)
    internal_fragmentation: int  # reserved slots past the request's final length: never used
    external_fragmentation: int  # slots of free holes shorter than max_model_len: no reservation fits them

    @property
    def occupied(self) -> int:
        """Memory no new request can use: everything but the usable free space (the holes that can
        still take a max_model_len reservation)."""
        return self.token_states + self.reserved + self.internal_fragmentation + self.external_fragmentation

    @property
    def free(self) -> int:
        """Slots no reservation holds, the too-small holes (external fragmentation) included."""
        return self.total - self.token_states - self.reserved - self.internal_fragmentation

    def fraction(self, part: int) -> float:
        """part / occupied: a share of the memory no new request can use (0.0 when nothing is occupied)."""
        return part / self.occupied if self.occupied else 0.0

    @property
    def token_state_fraction(self) -> float:
        """Share of the occupied KV memory that holds token states (vLLM: ~96%; before it: 20–38%)."""
        return self.fraction(self.token_states)


class ContiguousKVCache:
    """One arena of num_slots token slots; each request gets one contiguous reservation, first fit.

    Errors: a num_slots or max_model_len below 1 raises ValueError naming it; any call about a request
    that holds no reservation (never admitted, or released) raises KeyError ("... no reservation ...").
    A refused call changes nothing.
    """

    num_slots: int  # token slots in the arena
    max_model_len: int  # the largest reservation, and admit's default
    reservations: dict[int, Reservation]  # request id -> its stretch, from admit until release
    k: np.ndarray | None  # [num_slots, num_kv_heads, head_dim], NaN until written; None without storage
    v: np.ndarray | None  # the same, for V

    def __init__(self, num_slots: int, max_model_len: int, num_kv_heads: int = 0, head_dim: int = 0,
                 dtype=np.float32) -> None:
        if num_slots < 1 or max_model_len < 1:
            raise ValueError(f"num_slots and max_model_len must be positive, got {num_slots}, {max_model_len}")
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.reservations: dict[int, Reservation] = {}
        # Storage is optional: the memory benchmark only needs the accounting.
        self.k = self.v = None
        if num_kv_heads and head_dim:
            self.k = np.full((num_slots, num_kv_heads, head_dim), np.nan, dtype=dtype)  # [num_slots, Hkv, d]
            self.v = np.full((num_slots, num_kv_heads, head_dim), np.nan, dtype=dtype)

    def holes(self) -> list[tuple[int, int]]:
        """Free stretches (start, length) in address order."""
        holes, cursor = [], 0
        for r in sorted(self.reservations.values(), key=lambda r: r.start):
            if r.start > cursor:
                holes.append((cursor, r.start - cursor))
            cursor = r.start + r.capacity
        if cursor < self.num_slots:
            holes.append((cursor, self.num_slots - cursor))
        return holes

    def find_hole(self, size: int) -> int | None:
        """First fit: the lowest-addressed hole that holds `size` slots."""
        return next((start for start, length in self.holes() if length >= size), None)

    def admit(self, request_id: int, max_len: int | None = None) -> int:
        """Reserve max_len (default max_model_len) contiguous slots for a request, first fit; returns
        its start. Raises ValueError ("already admitted") for a request that holds a reservation,
        MaxModelLenError for a max_len outside 1..max_model_len, and NoContiguousSpaceError when no hole
        holds max_len slots (even if as many are free in total); a refused request holds nothing."""
        size = self.max_model_len if max_len is None else max_len
        if request_id in self.reservations:
            raise ValueError(f"request {request_id} is already admitted")
        if not 1 <= size <= self.max_model_len:
            raise MaxModelLenError(f"reservation of {size} slots is outside 1..max_model_len={self.max_model_len}")
        start = self.find_hole(size)
        if start is None:
            free = self.num_slots - sum(r.capacity for r in self.reservations.values())
            largest = max((length for _, length in self.holes()), default=0)
            raise NoContiguousSpaceError(
                f"no hole of {size} slots for request {request_id}: {free} slots free in total, largest hole {largest}")
        self.reservations[request_id] = Reservation(start, size)
        return start

    def _get(self, request_id: int) -> Reservation:
        if request_id not in self.reservations:
            raise KeyError(f"request {request_id} holds no reservation (never admitted, or released)")
        return self.reservations[request_id]

    def append(self, request_id: int, k: np.ndarray | None = None, v: np.ndarray | None = None,
               num_tokens: int | None = None) -> range:
        """Give the next slots of the reservation to n new tokens and return them (a range): with k/v
        ([n, num_kv_heads, head_dim] each) they are stored there, with num_tokens=n only counted (the
        caller writes K/V itself, or the cache has no storage). Raises MaxModelLenError past the
        reservation and ValueError ("num_tokens") for neither k nor a count >= 0; both change nothing."""
        r = self._get(request_id)
        n = len(k) if k is not None else num_tokens
        if n is None or n < 0:
            raise ValueError(f"append needs the new tokens' k/v or num_tokens >= 0, got {n}")
        if r.num_tokens + n > r.capacity:
            raise MaxModelLenError(f"request {request_id}: {r.num_tokens} + {n} tokens exceed its reservation of {r.capacity}")
        slots = range(r.start + r.num_tokens, r.start + r.num_tokens + n)
        if k is not None and self.k is not None:
            self.k[slots.start:slots.stop] = k
            self.v[slots.start:slots.stop] = v
        r.num_tokens += n
        return slots

    def read(self, request_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The request's K/V so far: [num_tokens, num_kv_heads, head_dim] each (views, no copy).
        Raises ValueError ("... storage ...") for a cache built without storage (num_kv_heads=0)."""
        r = self._get(request_id)
        if self.k is None:
            raise ValueError("this cache was built without storage (num_kv_heads=0)")
        return self.k[r.start:r.start + r.num_tokens], self.v[r.start:r.start + r.num_tokens]

    def attention(self, request_id: int, q: np.ndarray, scale: float | None = None) -> np.ndarray:
        """Attention of the request's newest q tokens over its whole context: the oracle itself."""
        k, v = self.read(request_id)
        return attention(q, k, v, scale=scale)

    def release(self, request_id: int) -> None:
        """Give the request's whole stretch back as a hole. Releasing twice raises KeyError."""
        self._get(request_id)
        del self.reservations[request_id]

    def usage(self, final_lens: Mapping[int, int] | None = None) -> MemoryUsage:
        """Accounting by purpose. final_lens (each request's eventual length, known only to an observer)
        splits the unused part of a reservation into reserved (will be used) and internal fragmentation;
        without it, all of it counts as reserved. External fragmentation counts only the holes shorter
        than max_model_len: a hole that can take a reservation is usable free memory."""
        tokens = reserved = internal = 0
        for rid, r in self.reservations.items():
            final = r.capacity if final_lens is None else min(max(final_lens[rid], r.num_tokens), r.capacity)
            tokens += r.num_tokens
            reserved += final - r.num_tokens
            internal += r.capacity - final
        external = sum(length for _, length in self.holes() if length < self.max_model_len)
        return MemoryUsage(self.num_slots, tokens, reserved, internal, external)
