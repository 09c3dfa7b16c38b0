"""fp8route.device on the CPU: the cycle collector held off within collector_off (and capture_graph,
whose GPU half is tests/gpu/test_engine_gpu.py), and back as it was after, also after an error."""

from __future__ import annotations

import gc

import pytest

from fp8route.device import collector_off


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_within_and_as_it_was_after(enabled: bool) -> None:
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_off():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(ValueError), collector_off():
            raise ValueError("a capture that fails")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
