"""Errors as OpenAI sends them: {"error": {"message", "type", "param", "code"}}, the message one
sentence that names what was wrong and what to do."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from fp8route.serve.protocol import InvalidParam, short

_TYPES = {401: "authentication_error"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def from_validation(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as one sentence naming the field."""
    first = exc.errors(include_url=False)[0]
    loc, kind = tuple(first.get("loc", ())), first["type"]
    param = str(loc[0]) if loc else None
    error = first.get("ctx", {}).get("error")
    if isinstance(error, InvalidParam):
        return APIError(400, str(error), param=error.param or param, code=error.code)
    where = _where(loc)
    if kind == "missing":
        message = f"'{where}' is required"
    elif kind == "extra_forbidden":
        return APIError(
            400, f"unrecognized request argument '{where}': this server does not support it; leave it out",
            param=param, code="unsupported_parameter",
        )  # fmt: skip
    else:
        detail = first["msg"].removeprefix("Value error, ")
        message = f"'{where}': {detail[:1].lower()}{detail[1:]}, got {short(first.get('input'))}"
    return APIError(400, message, param=param)
