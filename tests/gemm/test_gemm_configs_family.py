"""Config tables per GPU family (gemm/configs.py): lookup by family, the default device's
family, and a clear error for an unknown one."""

from __future__ import annotations

import pytest

from nvfp4_jax.device import is_sm12x
from nvfp4_jax.gemm import configs


def test_each_family_reads_its_own_table():
    for fam, table in configs.TUNED_BY_FAMILY.items():
        for (mb, n, k), cfg in table.items():
            assert configs.get_config(mb, n, k, family=fam) is cfg
    # the two tables differ where sm_120's 99 KB per CTA rules the H200 tile out
    key = (64, 28672, 8192)
    assert configs.TUNED_SM12X[key] != configs.TUNED[key]


def test_default_family_follows_the_device():
    assert configs.device_family() == ("sm12x" if is_sm12x() else "sm90")
    fam = configs.device_family()
    assert configs.get_config(16, 28672, 8192) is configs.get_config(16, 28672, 8192, family=fam)


def test_nearest_entry_is_taken_within_the_family():
    # 14336 x 4096 is not listed: the nearest weight size of the same bucket answers
    got = configs.get_config(16, 14336, 4096, family="sm12x")
    assert got is configs.TUNED_SM12X[(16, 4096, 4096)]


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="family: expected one of"):
        configs.get_config(16, 4096, 4096, family="sm100")
