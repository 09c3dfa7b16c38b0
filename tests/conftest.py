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
