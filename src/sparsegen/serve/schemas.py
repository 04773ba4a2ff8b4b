"""The OpenAI API's request bodies and error shape: `{"error": {"message", "type", "param", "code"}}`,
with a 4xx status for bad input (400 invalid request, 404 unknown model) and 500 only for a
failure inside a request."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # what a generator's seed can hold
    stream: bool = False
    n: int = 1
    kv_policy: str | None = None
    kv_budget: int | float | None = None
    kv_bits: Literal[2, 3, 4, 8] | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, defaults: dict) -> dict:
        """Sampling settings: `defaults` (the model's generation config) where the request says nothing."""
        return {
            "temperature": defaults["temperature"] if self.temperature is None else self.temperature,
            "top_p": defaults["top_p"] if self.top_p is None else self.top_p,
            "stop": self.stops(),
            "seed": self.seed,
        }


class ChatRequest(Sampling):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
