"""A step on its way: launched on the device, its tokens read back when the engine needs them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8route.engine.request import Request
from fp8route.engine.scheduler import Step


@dataclass
class InFlight:
    """A launched step's plan, whom its tokens are for, and those tokens: on the device and (on a GPU,
    with copy) on their way to pinned host memory right behind the step, so that waiting for them
    does not wait for a step launched after it (async scheduling launches the next one first)."""

    plan: Step
    sampling: list[Request]
    sampled: torch.Tensor | None
    host: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None

    @classmethod
    def start(cls, plan: Step, sampled: torch.Tensor | None, sampling: list[Request], copy: bool) -> InFlight:
        """copy: take the tokens as they are now (else tokens() reads them when asked), which a step
        launched after this one needs: a CUDA graph's replay overwrites the outputs of the last."""
        if sampled is None or not copy:
            return cls(plan, sampling, sampled)
        if not sampled.is_cuda:
            return cls(plan, sampling, sampled, sampled.clone())
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(plan, sampling, sampled, host, copied)

    def tokens(self) -> list[int]:
        """The step's tokens on the host: the one wait for the GPU."""
        if self.sampled is None:
            return []
        if self.copied is not None:
            self.copied.synchronize()
        return (self.host if self.host is not None else self.sampled).tolist()
