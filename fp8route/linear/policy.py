"""How a user steers planning: strict mode, a forced backend, disabled backends."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fp8route.backends import BACKENDS
from fp8route.errors import Fp8InputError

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Policy:
    strict: bool = False
    force: str | None = None
    disable: frozenset[str] = frozenset()
    # Only backends whose rows do not depend on M, one per layer (EngineConfig.deterministic).
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name in (*self.disable, *([self.force] if self.force else [])):
            if name not in BACKENDS:
                raise Fp8InputError(
                    f"unknown backend {name!r} in the routing policy (FP8ROUTE_FORCE / FP8ROUTE_DISABLE); "
                    f"known: {', '.join(BACKENDS)}"
                )
        if "reference" in self.disable:
            raise Fp8InputError("backend 'reference' cannot be disabled: it is what runs when nothing else can")
        if self.force in self.disable:
            raise Fp8InputError(f"backend {self.force!r} is both forced and disabled")

    @classmethod
    def from_env(
        cls, strict: bool | None = None, force: str | None = None, disable: frozenset[str] | None = None
    ) -> Policy:
        """Arguments win over FP8ROUTE_STRICT, FP8ROUTE_FORCE and FP8ROUTE_DISABLE."""
        if strict is None:
            strict = os.environ.get("FP8ROUTE_STRICT", "").strip().lower() in _TRUE
        if force is None:
            force = os.environ.get("FP8ROUTE_FORCE", "").strip() or None
        if disable is None:
            raw = os.environ.get("FP8ROUTE_DISABLE", "")
            disable = frozenset(name.strip() for name in raw.split(",") if name.strip())
        return cls(strict=strict, force=force, disable=disable)
