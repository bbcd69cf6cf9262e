"""lp_ddp leaves DDP's bucketing to torch unless told (a small first bucket, all-reduced while the backward goes on,
then 25 MB buckets), and the planner counts the buckets the same way. No process group."""

from __future__ import annotations

import pytest

from lightning_parallel.planner.cost import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_bucket_bytes
from lightning_parallel.strategies import LPDDPStrategy

MB = 2**20


def test_the_default_leaves_the_bucket_size_to_torch_and_a_number_is_passed_on() -> None:
    assert "bucket_cap_mb" not in LPDDPStrategy()._ddp_kwargs
    assert LPDDPStrategy(bucket_cap_mb=5)._ddp_kwargs["bucket_cap_mb"] == 5
    with pytest.raises(ValueError, match=r"bucket_cap_mb=0 must be > 0"):
        LPDDPStrategy(bucket_cap_mb=0)


def test_the_planner_fills_buckets_as_torch_default_does() -> None:
    assert (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES) == (MB, 25 * MB)
    assert ddp_bucket_bytes(0.5 * MB) == [0.5 * MB]
    assert ddp_bucket_bytes(1.79 * MB) == pytest.approx([MB, 0.79 * MB])
    assert ddp_bucket_bytes(60 * MB) == [MB, 25 * MB, 25 * MB, 9 * MB]
    assert sum(ddp_bucket_bytes(1234.5 * MB)) == pytest.approx(1234.5 * MB)
