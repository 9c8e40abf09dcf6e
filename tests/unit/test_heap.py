"""The serving heap settings apply on this machine's C library."""

from __future__ import annotations

import gc
import platform

import pytest

from epp.server import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_large_buffers_is_accepted_by_glibc() -> None:
    assert heap.keep_large_buffers() is True


def test_settle_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        heap.settle()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == heap.GC_YOUNG_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
