"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Unknown fields are rejected (a typo must not silently become a default);
OpenAI fields kvq cannot honour are accepted only at their neutral value
(n=1, echo=false, best_of=1, ...) and otherwise answered with a 400 that names
the field. Ranges follow the OpenAI API reference.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # not in the OpenAI API; vLLM and SGLang accept it
    min_tokens: int = Field(0, ge=0)  # vLLM's extension (benchmarks use it to fix the output length)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's extension
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by kvq engines; leave it out")
        return v

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=0, description="log probability of the sampled token only")
    echo: Literal[False] = False
    best_of: int = Field(1, ge=1, le=1)
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"send one prompt per request (got {len(v)}); kvq batches concurrent requests")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, str):
            return v
        texts = []
        for part in v:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="log probability of the sampled token only")

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("send max_completion_tokens or max_tokens, not both")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
