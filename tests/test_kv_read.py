"""bench gather's read asks for decode's carve-out: the least share of the SM's shared memory that holds v3's 4 CTAs
(each with the 1 KB the driver reserves), so that L1 keeps the rest, as it does for decode (CPU: the arithmetic)."""

import pytest

from pagedref.kernels.kv_read import CTAS_PER_SM, DRIVER_RESERVED_KB, MAX_SHARED_KB, SM_SHARED_KB, carveout


@pytest.mark.parametrize("shared_kb", range(MAX_SHARED_KB + 1))
def test_the_carveout_is_the_least_percentage_that_holds_four_ctas(shared_kb):
    need = CTAS_PER_SM * (shared_kb + DRIVER_RESERVED_KB)  # KB an SM's CTAs take
    pct = carveout(shared_kb)
    assert 0 <= pct <= 100, f"a carve-out is a percentage, got {pct} for {shared_kb} KB"
    assert pct * SM_SHARED_KB >= 100 * need, f"{pct}% of {SM_SHARED_KB} KB does not hold {CTAS_PER_SM} CTAs of {shared_kb} + {DRIVER_RESERVED_KB} KB"
    assert (pct - 1) * SM_SHARED_KB < 100 * need, f"{pct - 1}% would hold them too: the read would give L1 away"
