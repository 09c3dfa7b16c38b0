"""DirectLauncher's bookkeeping with a fake kernel (the GPU tests run the real ones): Triton's path
once per key, pointer alignment, device and meta, then the compiled launcher with constexprs in order."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fp8route.kernels import launcher as launcher_module
from fp8route.kernels import options
from fp8route.kernels.launcher import DirectLauncher


class FakeCompiled:
    function, packed_metadata = "cufunction", "packed"

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []

    def run(self, *args: Any) -> None:
        self.launches.append(args)


class FakeJit:
    """Parameters x, y, n, then the constexprs B and C; fn[grid](...) compiles and launches."""

    __name__ = "fake_kernel"
    params = [SimpleNamespace(name=name) for name in ("x", "y", "n", "B", "C")]

    def __init__(self) -> None:
        self.jit_calls: list[tuple[Any, ...]] = []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def run(*args: Any, **meta: Any) -> FakeCompiled:
            self.jit_calls.append((grid, args, meta))
            return self.compiled

        return run


@pytest.fixture
def fake_triton(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    runtime = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, interpret=False)
    fake = SimpleNamespace(__version__="3.6.0", knobs=SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(launcher_module, "triton", fake)
    monkeypatch.setattr(launcher_module, "DIRECT", True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: f"stream{device}", raising=False)
    return fake


META = {"C": 3, "num_warps": 4, "B": 2}  # given by name in any order, options among them


def test_triton_once_per_key_then_the_compiled_launcher(fake_triton: SimpleNamespace) -> None:
    fn = FakeJit()
    launch = DirectLauncher(fn, pointers=2)
    x, y = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        launch((5,), "key", (x, y, 8), META)
    assert len(fn.jit_calls) == 1 and fn.jit_calls[0] == ((5,), (x, y, 8), META)
    # grid padded to 3-D, the stream of the tensors' device, no hooks, then every argument in
    # parameter order with the constexprs last (B before C, whatever order META gives them in).
    expected = (5, 1, 1, "stream-1", "cufunction", "packed", None, None, None, x, y, 8, 2, 3)
    assert fn.compiled.launches == [expected, expected]


def test_misaligned_pointer_or_new_key_goes_through_triton_again(fake_triton: SimpleNamespace) -> None:
    fn = FakeJit()
    launch = DirectLauncher(fn, pointers=2)
    buf = torch.zeros(16, dtype=torch.bfloat16)
    aligned, shifted = buf[:8], buf[1:9]  # 2 bytes apart: one of them is off 16-byte alignment
    launch((1,), "key", (aligned, aligned, 8), META)
    launch((1,), "key", (aligned, shifted, 8), META)
    launch((1,), "other key", (aligned, aligned, 8), META)
    assert len(fn.jit_calls) == 3 and fn.compiled.launches == []
    launch((1,), "key", (aligned, shifted, 8), META)
    assert len(fn.jit_calls) == 3 and len(fn.compiled.launches) == 1


def test_first_launches_count_each_new_key_once(fake_triton: SimpleNamespace) -> None:
    launch, x = DirectLauncher(FakeJit(), pointers=2), torch.zeros(8)
    before = launcher_module.first_launches()
    for key in ("a", "b", "a", "a", "b"):
        launch((1,), key, (x, x, 8), META)
    assert launcher_module.first_launches() - before == 2
    fake_triton.knobs.runtime.launch_enter_hook = lambda metadata: None  # Triton's path every call now
    launch((1,), "a", (x, x, 8), META)
    launch((1,), "c", (x, x, 8), META)
    assert launcher_module.first_launches() - before == 3


@pytest.mark.parametrize("version", ["3.4", "3.6"])
def test_a_launch_hook_keeps_triton_path(fake_triton: SimpleNamespace, version: str) -> None:
    # Triton 3.4 holds one hook or None; 3.5 on a chain of hooks, empty by default.
    idle, listening = (None, lambda metadata: None) if version == "3.4" else (Chain([]), Chain([print]))
    fake_triton.knobs.runtime.launch_enter_hook = idle
    fn = FakeJit()
    launch = DirectLauncher(fn, pointers=2)
    x = torch.zeros(8)
    launch((1,), "key", (x, x, 8), META)
    launch((1,), "key", (x, x, 8), META)
    assert len(fn.jit_calls) == 1 and len(fn.compiled.launches) == 1
    fake_triton.knobs.runtime.launch_enter_hook = listening  # a profiler listening
    launch((1,), "key", (x, x, 8), META)
    assert len(fn.jit_calls) == 2 and len(fn.compiled.launches) == 1


class Chain:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls


def test_other_triton_versions_always_use_triton_and_say_so_once(
    fake_triton: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(launcher_module, "DIRECT", False)
    fn = FakeJit()
    launch = DirectLauncher(fn, pointers=2)
    x = torch.zeros(8)
    with caplog.at_level(logging.WARNING, logger="fp8route"):
        for _ in range(3):
            launch((1,), "key", (x, x, 8), META)
    assert len(fn.jit_calls) == 3 and fn.compiled.launches == []
    assert len([r for r in caplog.records if "fake_kernel" in r.getMessage()]) == 1


def test_a_constexpr_the_key_leaves_out_still_gets_its_own_kernel(fake_triton: SimpleNamespace) -> None:
    # rope's key once left out its head size (HALF): a head of 128 ran the kernel compiled for 32.
    fn = FakeJit()
    launch = DirectLauncher(fn, pointers=2)
    x = torch.zeros(8)
    for b in (2, 4, 2, 4):
        launch((1,), "same key", (x, x, 8), {"B": b, "C": 3, "num_warps": 4})
    launch((1,), "same key", (x, x, 8), {"B": 2, "C": 3, "num_warps": 8})  # a launch option too
    assert [call[2]["B"] for call in fn.jit_calls] == [2, 4, 2]
    assert [call[2]["num_warps"] for call in fn.jit_calls] == [4, 4, 8]
    # Each direct launch passes (and was compiled with) the constexprs of its own call.
    assert [launched[-2:] for launched in fn.compiled.launches] == [(2, 3), (4, 3)]


class FakePdlJit(FakeJit):
    """FakeJit with USE_PDL as a constexpr, as a kernel given to a DirectLauncher with pdl=True has."""

    params = [*FakeJit.params, SimpleNamespace(name="USE_PDL")]


def test_pdl_is_a_launch_option_and_part_of_the_key(
    fake_triton: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(options, "why_not_pdl", lambda device=None: None)  # as on a Hopper GPU
    fn = FakePdlJit()
    launch = DirectLauncher(fn, pointers=2, pdl=True)
    x = torch.zeros(8)
    try:
        for on in (False, True, False, True):
            options.set_kernel_options(pdl=on)
            launch((1,), "key", (x, x, 8), META)
    finally:
        options.set_kernel_options(pdl=False)
    # Triton once per setting, the launch option only when on; then each setting's own constexprs.
    assert [call[2] for call in fn.jit_calls] == [
        {**META, "USE_PDL": False},
        {**META, "USE_PDL": True, "launch_pdl": True},
    ]
    assert [launched[-3:] for launched in fn.compiled.launches] == [(2, 3, False), (2, 3, True)]
