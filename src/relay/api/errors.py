"""The error every API route raises for a request it refuses (ProtocolError: a status, a
message and the field at fault), and the OpenAI and Anthropic shapes of its body."""

from __future__ import annotations

from typing import Any

_DEFAULT_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class ProtocolError(Exception):
    """A request the server refuses; maps one-to-one onto an OpenAI error response."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _default_error_type(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.type)

    def renamed(self, names: dict[str, str]) -> ProtocolError:
        """This error naming its field as `names` maps it: one prompt's of a batch (`prompt`
        as `prompt[2]`) or a pipeline stage's name as the route's (`prompt` as `text`)."""
        return ProtocolError(
            self.status, self.message, names.get(self.param, self.param), self.type
        )


def _default_error_type(status: int) -> str:
    if status >= 500:
        return "internal_server_error" if status == 500 else "server_error"
    return _DEFAULT_ERROR_TYPES.get(status, "invalid_request_error")


def error_body(
    status: int, message: str, param: str | None = None, type: str | None = None
) -> dict[str, Any]:
    # The nested "error" object is what the openai client reads to build BadRequestError etc.
    return {
        "object": "error",
        "error": {
            "message": message,
            "type": type or _default_error_type(status),
            "param": param,
            "code": status,
        },
    }


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape (/v1/messages): the message names the field at fault."""
    kind = _ANTHROPIC_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}


def bad(param: str | None, message: str) -> ProtocolError:
    return ProtocolError(400, message, param)


def show(value: Any) -> str:
    # Bodies are attacker-sized; never echo a megabyte back in an error message.
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
