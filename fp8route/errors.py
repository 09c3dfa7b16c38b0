"""Errors a user can act on: each names the tensor or layer, what was expected and what came."""

from __future__ import annotations


class Fp8RouteError(Exception):
    """Base class of every error fp8route raises on purpose."""


class Fp8InputError(Fp8RouteError, ValueError):
    """A tensor or argument has the wrong shape, value or layout."""


class Fp8TypeError(Fp8RouteError, TypeError):
    """A tensor has the wrong dtype or an argument the wrong type."""


class BackendUnavailableError(Fp8RouteError, RuntimeError):
    """A backend was forced or required but cannot run this layer; the message says why."""


class StrictModeError(Fp8RouteError, RuntimeError):
    """strict=True (or FP8ROUTE_STRICT=1) turned a fallback into an error."""


class CheckpointError(Fp8InputError):
    """A checkpoint folder, its config or one of its tensors is missing, malformed or unsupported."""
