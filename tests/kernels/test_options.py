"""The kernel options without a GPU: PDL refused with its reason where it cannot run, and any change
of an option a change of plans_epoch (captured graphs are captured again). How the launcher applies
PDL is in test_launcher.py."""

from __future__ import annotations

import pytest

from fp8route.errors import Fp8InputError
from fp8route.kernels import options, pdl
from fp8route.linear.layer import plans_epoch


@pytest.fixture
def pdl_possible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "why_not_pdl", lambda device=None: None)
    yield
    options.set_kernel_options(pdl=False)


def test_refused_with_its_reason_where_it_cannot_run() -> None:
    reason = options.why_not_pdl()
    if reason is None:
        pytest.skip("this machine can launch with PDL")
    with pytest.raises(Fp8InputError, match="programmatic dependent launch: ") as error:
        options.set_kernel_options(pdl=True)
    assert reason in str(error.value) and not options.kernel_options().pdl
    assert pdl.launch_options() == {"USE_PDL": False}


def test_changing_an_option_moves_the_epoch_that_graphs_check(pdl_possible: None) -> None:
    before = plans_epoch()
    options.set_kernel_options(pdl=True)
    on = plans_epoch()
    assert on != before and pdl.launch_options() == {"USE_PDL": True, "launch_pdl": True}
    assert options.set_kernel_options(pdl=True) == options.KernelOptions(pdl=True)  # no change, no new epoch
    assert plans_epoch() == on
    options.set_kernel_options(quantize_upstream=False)  # the other option: pdl stays on
    both = plans_epoch()
    assert both != on and options.kernel_options() == options.KernelOptions(pdl=True, quantize_upstream=False)
    options.set_kernel_options(pdl=False, quantize_upstream=True)
    assert plans_epoch() not in (before, on, both) and pdl.launch_options() == {"USE_PDL": False}


def test_a_triton_whose_gdc_wait_does_not_compile_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = pytest.importorskip("triton.language.extra.cuda", reason="needs triton")
    compiler = pytest.importorskip("triton.backends.nvidia.compiler", reason="needs triton")
    has_option = "launch_pdl" in compiler.CUDAOptions.__dataclass_fields__

    def current(_semantic=None):  # Triton 3.5 on
        pass

    def old(_builder=None):  # Triton 3.4's, whose compiler passes _semantic (results/cpu/sm90_compile/)
        pass

    monkeypatch.setattr(cuda, "gdc_launch_dependents", current, raising=False)
    monkeypatch.setattr(cuda, "gdc_wait", current, raising=False)
    assert options.triton_compiles_pdl() == has_option
    monkeypatch.setattr(cuda, "gdc_wait", old)
    assert not options.triton_compiles_pdl()


def test_capturing_with_sets_pdl_for_one_capture_and_keeps_the_epoch(pdl_possible: None) -> None:
    before, epoch = options.kernel_options(), plans_epoch()
    with options.capturing_with(pdl=True):
        assert options.kernel_options() == options.KernelOptions(pdl=True, quantize_upstream=before.quantize_upstream)
        assert pdl.launch_options() == {"USE_PDL": True, "launch_pdl": True}
        assert plans_epoch() == epoch  # the graph captured here is kept
    assert options.kernel_options() == before and plans_epoch() == epoch
    with pytest.raises(RuntimeError), options.capturing_with(pdl=True):
        raise RuntimeError("a capture that fails")
    assert options.kernel_options() == before
