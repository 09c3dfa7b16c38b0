"""The kernel options without a GPU: PDL refused with its reason where it cannot run, and where it
can (faked here) a launch option of every kernel that declares USE_PDL, in the launcher's key; any
change of an option a change of plans_epoch (captured graphs are captured again)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fp8route.backends.kernels import launcher as launcher_module
from fp8route.backends.kernels import options, pdl
from fp8route.backends.kernels.launcher import DirectLauncher
from fp8route.errors import Fp8InputError
from fp8route.linear.layer import plans_epoch


@pytest.fixture
def pdl_possible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "why_not_pdl", lambda device=None: None)
    yield
    options.set_kernel_options(pdl=False, silu_in_down=False)


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
    options.set_kernel_options(silu_in_down=True)  # the other option: pdl stays on
    both = plans_epoch()
    assert both != on and options.kernel_options() == options.KernelOptions(pdl=True, silu_in_down=True)
    options.set_kernel_options(pdl=False, silu_in_down=False)
    assert plans_epoch() not in (before, on, both) and pdl.launch_options() == {"USE_PDL": False}


class FakeCompiled:
    function, packed_metadata = "cufunction", "packed"

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []

    def run(self, *args: Any) -> None:
        self.launches.append(args)


class FakeJit:
    """Parameters x, n, then the constexprs B and USE_PDL."""

    __name__ = "fake_kernel"
    params = [SimpleNamespace(name=name) for name in ("x", "n", "B", "USE_PDL")]

    def __init__(self) -> None:
        self.jit_calls: list[dict[str, Any]] = []
        self.compiled: list[FakeCompiled] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def run(*args: Any, **meta: Any) -> FakeCompiled:
            self.jit_calls.append(meta)
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]

        return run


def test_the_launcher_compiles_and_keys_each_setting_apart(pdl_possible: None, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(
        launcher_module, "triton", SimpleNamespace(__version__="3.6.0", knobs=SimpleNamespace(runtime=runtime))
    )
    monkeypatch.setattr(launcher_module, "DIRECT", True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    fn = FakeJit()
    launch = DirectLauncher(fn, pointers=1, pdl=True)
    x = torch.zeros(8)
    for on in (False, True, False, True):
        options.set_kernel_options(pdl=on)
        launch((1,), "key", (x, 8), {"B": 2, "num_warps": 4})
    # Triton once per setting, with the launch option only when on; then each its own binary,
    # launched with its own USE_PDL among the constexprs.
    assert fn.jit_calls == [
        {"B": 2, "num_warps": 4, "USE_PDL": False},
        {"B": 2, "num_warps": 4, "USE_PDL": True, "launch_pdl": True},
    ]
    off, on = fn.compiled
    assert [launch_args[-2:] for launch_args in off.launches] == [(2, False)]
    assert [launch_args[-2:] for launch_args in on.launches] == [(2, True)]
