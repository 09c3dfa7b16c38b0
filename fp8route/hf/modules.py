"""Swapping a transformers model's nn.Linear modules for Fp8Linear, by module name."""

from __future__ import annotations

import torch
from torch import nn

from fp8route.errors import CheckpointError


class PendingFp8Linear(nn.Module):
    """Stands where an FP8 linear goes while transformers loads everything else.

    It has no parameters, so transformers neither allocates nor reads the FP8 tensors (they are
    left to fp8route's checkpoint reader, which checks them); it is replaced by the Fp8Linear
    once loading is done, and refuses to run before that."""

    def __init__(self, name: str, in_features: int, out_features: int) -> None:
        super().__init__()
        self.name, self.in_features, self.out_features = name, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.name}: the FP8 layer was never loaded (the model's loading did not finish)")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, pending"


def get_module(model: nn.Module, name: str, what: str) -> nn.Module:
    """model's submodule `name`, or a CheckpointError that says which one is missing."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise CheckpointError(
            f"{what} {name} has no module of that name in {type(model).__name__}; "
            "fp8route.hf loads checkpoints whose tensor names match the transformers model's modules"
        ) from None


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put module at `name` (a dotted path) in model, in place of whatever is there."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def device_near(model: nn.Module, name: str) -> torch.device:
    """The device of the closest loaded tensor around module `name`: its parent's, its
    grandparent's... (a decoder layer's norms sit on the device its linears belong on)."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        scope = model.get_submodule(".".join(parts[:depth])) if depth else model
        for tensor in (*scope.parameters(), *scope.buffers()):
            if tensor.device.type != "meta":
                return tensor.device
    return torch.device("cpu")
