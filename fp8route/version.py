"""The package version, in one place (the routing fingerprint records it)."""

__version__ = "0.1.0"
