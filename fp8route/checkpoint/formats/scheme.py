"""The canonical description every format's config is turned into."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from fp8route.errors import CheckpointError
from fp8route.schemes import DESCRIPTION, Scheme

SERVED = (
    "fp8route loads e4m3 linears per tensor (static or dynamic input scale), per output channel with "
    "dynamic per-token input, or in 128x128 blocks with dynamic 1x128 input groups (docs/checkpoints.md)"
)


def unsupported(field: str, value: object, file: str, why: str = "") -> CheckpointError:
    return CheckpointError(f"unsupported: {field}={value} in {file}; {why or SERVED}")


def describe(scheme: Scheme, static_input: bool) -> str:
    """How messages and reports name a scheme with its input scaling."""
    if scheme == "tensor":
        return f"per-tensor scales, {'static' if static_input else 'dynamic'} input scale"
    return DESCRIPTION[scheme]


@dataclass(frozen=True)
class QuantScheme:
    format: str  # "modelopt", "compressed-tensors" or "fp8"
    source: str  # the file(s) the scheme was read from
    exclude: tuple[str, ...]  # modules left unquantized: names, fnmatch wildcards or "re:" regexes
    kv_cache: str | None = None  # "FP8" when the checkpoint carries k_scale/v_scale
    fp8_scheme: Scheme = "tensor"  # how each linear's weight and input are scaled (fp8route.schemes)
    static_input: bool = True  # a per-tensor input_scale per linear (the tensor scheme's static form)
    scale_name: str = "weight_scale"  # "weight_scale_inv" in quant_method "fp8" block checkpoints
    # The config key and value that chose fp8_scheme, with its file: what an error about a tensor
    # that disagrees with the scheme names.
    origin: str = field(default="", compare=False)

    @property
    def description(self) -> str:
        return describe(self.fp8_scheme, self.static_input)

    def excludes(self, module: str) -> bool:
        return any(_matches(module, pattern) for pattern in self.exclude)


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        # compressed-tensors' convention: re.match against the module name.
        return re.match(pattern[3:], module) is not None
    # ModelOpt writes `x*` to exclude the module tree rooted at x: fnmatch's `*` crosses dots,
    # so it matches `x` and `x.*` already. An exact name excludes its children too.
    return module == pattern or module.startswith(pattern + ".") or fnmatchcase(module, pattern)
