"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with a 4xx status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error the client gets as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized() -> ApiError:
    return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error", None, "invalid_api_key")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over the limit of {limit} bytes", "invalid_request_error",
                    None, "request_too_large")


def overloaded(waiting: int) -> ApiError:
    return ApiError(429, f"server busy: {waiting} requests already wait for a batch slot; retry later",
                    "rate_limit_error", None, "queue_full")


def internal(message: str) -> ApiError:
    return ApiError(500, f"internal error: {message}", "server_error", None, "internal_error")


def shutting_down(grace_s: float) -> ApiError:
    return ApiError(503, f"server shutting down: the answer was cut after the {grace_s:g} s grace period; "
                    "retry on a running server", "server_error", None, "server_shutting_down")
