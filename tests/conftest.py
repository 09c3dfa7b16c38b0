import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    # Tests marked interpreter run their kernels on CPU tensors under Triton's interpreter too.
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not (interpreting and "interpreter" in item.keywords):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kernel_options_as_a_process_starts():  # type: ignore[no-untyped-def]
    """Every test ends with the kernel options a process starts with: load_model applies its own to the
    process, and a test that sets one must not hand it to the next."""
    yield
    from fp8route.kernels.options import KernelOptions, set_kernel_options

    start = KernelOptions()
    set_kernel_options(pdl=start.pdl, quantize_upstream=start.quantize_upstream)
