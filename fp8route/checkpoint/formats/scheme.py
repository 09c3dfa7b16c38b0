"""The canonical description every format's config is turned into."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from fp8route.errors import CheckpointError


def unsupported(field: str, value: object, file: str) -> CheckpointError:
    return CheckpointError(
        f"unsupported: {field}={value} in {file}; fp8route loads static per-tensor FP8 only "
        "(e4m3 weights with one weight_scale and one static input_scale per linear)"
    )


@dataclass(frozen=True)
class QuantScheme:
    format: str  # "modelopt" or "compressed-tensors"
    source: str  # the file(s) the scheme was read from
    exclude: tuple[str, ...]  # modules left unquantized: names, fnmatch wildcards or "re:" regexes
    kv_cache: str | None = None  # "FP8" when the checkpoint carries k_scale/v_scale

    def excludes(self, module: str) -> bool:
        return any(_matches(module, pattern) for pattern in self.exclude)


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        # compressed-tensors' convention: re.match against the module name.
        return re.match(pattern[3:], module) is not None
    # ModelOpt writes `x*` to exclude the module tree rooted at x: fnmatch's `*` crosses dots,
    # so it matches `x` and `x.*` already. An exact name excludes its children too.
    return module == pattern or module.startswith(pattern + ".") or fnmatchcase(module, pattern)
