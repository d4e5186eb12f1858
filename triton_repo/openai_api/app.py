"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions.

Every request becomes one gRPC stream to the engine model (triton_stream.py);
responses are JSON or server-sent events in OpenAI's chunk format. A client
that disconnects cancels its stream, and Triton passes that on to the engine.
Errors use OpenAI's shape: 400 for a bad field (named in `param`), 404 for an
unknown model, 503 when Triton cannot be reached, 500 when the engine fails.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from runtime.errors import KvqError, RequestError, ServerError

from .schemas import ChatCompletionRequest, CompletionRequest, OpenAIError
from .text import ChoiceText
from .triton_stream import EngineModel, EngineRequest, TokenStep, TritonStreams, dumps, engine_error_is_internal

# A prompt longer than this many bytes per token of max_input_len is refused before tokenization
# (tokenizing megabytes blocks for seconds); byte-level BPE tokens of real text are far shorter.
MAX_PROMPT_BYTES_PER_TOKEN = 32
DISCONNECT_POLL_S = 0.2
_ENGINE_FIELDS = {
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "min_tokens": ("min_length", 0),
}


@dataclass
class Served:
    """What every route needs: the engine model, its tokenizer, the public model name, the streams."""

    model: EngineModel
    tokenizer: Any
    name: str
    streams: TritonStreams
    created: int


# ------------------------------------------------------------------ prompts
def _check_prompt_bytes(served: Served, text: str, param: str) -> None:
    limits = served.model.limits
    if limits is not None and len(text.encode("utf-8", "surrogatepass")) > limits.max_input_len * MAX_PROMPT_BYTES_PER_TOKEN:
        raise OpenAIError(
            400,
            f"{param} is {len(text.encode('utf-8', 'surrogatepass'))} bytes, more than this engine's max_input_len "
            f"{limits.max_input_len} tokens can hold; shorten it.",
            param,
        )


def completion_prompt_ids(served: Served, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        _check_prompt_bytes(served, prompt, "prompt")
        return list(served.tokenizer(prompt)["input_ids"])  # as the ensemble's preprocessing does
    vocab = len(served.tokenizer)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(400, f"prompt has token ids outside [0, {vocab}): {bad[:5]}", "prompt")
    return list(prompt)


def chat_prompt_ids(served: Served, req: ChatCompletionRequest) -> list[int]:
    tok = served.tokenizer
    if not getattr(tok, "chat_template", None):
        raise OpenAIError(400, f"model {served.name} has no chat template; use /v1/completions.", "messages")
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.content} for m in req.messages]
    _check_prompt_bytes(served, "".join(m["content"] for m in messages), "messages")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])  # the template carries the specials


def engine_request(served: Served, req, ids: list[int], max_tokens: int | None, logprobs: bool) -> EngineRequest:
    limits = served.model.limits
    if max_tokens is None:  # chat default: as many as the context allows
        max_tokens = max(1, limits.max_seq_len - len(ids)) if limits is not None else 16
    if limits is not None:
        try:
            limits.check(len(ids), max_tokens)
        except RequestError as e:
            param = "max_tokens" if "max_tokens" in str(e) else ("messages" if hasattr(req, "messages") else "prompt")
            raise OpenAIError(400, str(e), param) from e
    extra: dict[str, Any] = {}
    # OpenAI/vLLM field -> (tensorrt_llm input, neutral value)
    for name, (engine_name, neutral) in _ENGINE_FIELDS.items():
        value = getattr(req, name)
        if value != neutral:
            if not served.model.supports(engine_name):
                raise OpenAIError(400, f"{name} is not supported by this deployment's engine; send {neutral}.", name)
            extra[engine_name] = value
    if logprobs and not served.model.supports("return_log_probs"):
        raise OpenAIError(
            400, "this deployment's engine model returns no log probabilities; redeploy it with `kvq deploy`.",
            "logprobs",
        )
    return EngineRequest(
        ids, max_tokens, req.temperature, req.top_p, top_k=req.top_k, seed=req.seed, logprobs=logprobs, extra=extra
    )


# ------------------------------------------------------------- generation
async def _steps(served: Served, ereq: EngineRequest) -> AsyncIterator[TokenStep]:
    """The engine's steps, with Triton's errors turned into OpenAI errors."""
    try:
        async for step in served.streams.generate(ereq):
            yield step
    except RequestError as e:
        status = 500 if engine_error_is_internal(str(e)) else 400
        raise OpenAIError(status, str(e), None, "engine_error" if status == 500 else None) from e
    except ServerError as e:
        raise OpenAIError(503, str(e), None, "triton_unavailable") from e


def finish_reason(choice: ChoiceText, served: Served, max_tokens: int) -> str:
    if choice.stopped:
        return "stop"
    eos = served.tokenizer.eos_token_id
    if len(choice.ids) >= max_tokens and not (choice.ids and choice.ids[-1] == eos):
        return "length"
    return "stop"


def usage(prompt_len: int, choice: ChoiceText) -> dict[str, int]:
    n = len(choice.ids)
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def _logprobs_json(chat: bool, choice: ChoiceText, start: int, end: int) -> dict | None:
    toks = [choice.tokenizer.decode([i]) for i in choice.ids[start:end]]
    lps = choice.logprobs[start:end]
    if chat:
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(toks, lps)
            ]
        }
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}


async def _until_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def run_whole(served: Served, request: Request, ereq: EngineRequest, choice: ChoiceText) -> None:
    """Generate to the end; a client that hangs up meanwhile cancels the generation."""

    async def collect() -> None:
        async for step in _steps(served, ereq):
            choice.add(step.ids, step.logprobs, step.final)
            if choice.stopped:
                return  # leaving the stream cancels the rest in the engine

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        raise asyncio.CancelledError()
    work.result()


def _sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


async def run_stream(
    served: Served, ereq: EngineRequest, choice: ChoiceText, chunk, include_usage: bool, logprobs: bool, chat: bool
) -> StreamingResponse:
    """SSE response. The first engine step is awaited before answering, so a request the engine
    refuses still gets its HTTP error status instead of an error inside a 200 stream."""
    steps = _steps(served, ereq).__aiter__()
    try:
        first = await steps.__anext__()
    except StopAsyncIteration:
        first = TokenStep([], None, True)

    async def events() -> AsyncIterator[bytes]:
        step: TokenStep | None = first
        try:
            if chat:
                yield _sse(chunk({"role": "assistant", "content": ""}, None, None))
            while step is not None:
                start = len(choice.ids)
                text = choice.add(step.ids, step.logprobs, step.final)
                lp = _logprobs_json(chat, choice, start, len(choice.ids)) if logprobs and step.ids else None
                done = step.final or choice.stopped
                if text or lp:
                    yield _sse(chunk(text, lp, None))
                if done:
                    break
                step = await steps.__anext__()
            yield _sse(chunk("" if not chat else {}, None, finish_reason(choice, served, ereq.max_tokens)))
            if include_usage:
                yield _sse(chunk(None, None, None, usage(len(ereq.input_ids), choice)))
        except OpenAIError as e:  # the response has begun: the error travels as an event
            yield _sse(e.body())
        finally:
            await steps.aclose()  # cancels the engine request when the client left or a stop matched
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# ------------------------------------------------------------------ the app
def create_app(served_factory) -> FastAPI:
    """`served_factory()` returns the Served deployment; called once, inside the server's event loop."""
    state: dict[str, Served] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served = served_factory()
        await served.streams.open()
        state["served"] = served
        yield
        await served.streams.close()

    app = FastAPI(title="kvq OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        # pydantic names the union member that failed: keep the field, drop the type tags
        where = ".".join(x for x in loc if not any(c in x for c in "[]()")) or "body"
        return JSONResponse(OpenAIError(400, f"{where}: {err.get('msg')}", param).body(), status_code=400)

    @app.exception_handler(KvqError)
    async def _kvq_error(request: Request, e: KvqError):
        status = 503 if isinstance(e, ServerError) else 400 if isinstance(e, RequestError) else 500
        return JSONResponse(OpenAIError(status, str(e)).body(), status_code=status)

    def _served(model: str) -> Served:
        served = state["served"]
        if model != served.name:
            raise OpenAIError(
                404, f"the model {model!r} does not exist here; this server serves {served.name!r}.", "model",
                "model_not_found",
            )
        return served

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    def _model_card(served: Served) -> dict:
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "kvq"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state["served"])]}

    @app.get("/v1/models/{model}")
    async def model_card(model: str):
        return _model_card(_served(model))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        served = _served(req.model)
        ids = await asyncio.to_thread(completion_prompt_ids, served, req.prompt)
        logprobs = req.logprobs is not None
        ereq = engine_request(served, req, ids, req.max_tokens, logprobs)
        choice = ChoiceText(served.tokenizer, req.stops)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, lp, reason, use=None):
            choices = [] if use else [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": reason}]
            body = {"id": rid, "object": "text_completion", "created": created, "model": served.name,
                    "choices": choices}
            if use:
                body["usage"] = use
            return body

        if req.stream:
            return await run_stream(served, ereq, choice, chunk, req.include_usage, logprobs, chat=False)
        await run_whole(served, request, ereq, choice)
        body = chunk(choice.text, _logprobs_json(False, choice, 0, len(choice.ids)) if logprobs else None,
                     finish_reason(choice, served, ereq.max_tokens))
        body["usage"] = usage(len(ids), choice)
        return body

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        served = _served(req.model)
        ids = await asyncio.to_thread(chat_prompt_ids, served, req)
        ereq = engine_request(served, req, ids, req.token_limit, req.logprobs)
        choice = ChoiceText(served.tokenizer, req.stops)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta, lp, reason, use=None):
            if isinstance(delta, str):
                delta = {"content": delta}
            choices = [] if use else [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}]
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served.name,
                    "choices": choices}
            if use:
                body["usage"] = use
            return body

        if req.stream:
            return await run_stream(served, ereq, choice, chunk, req.include_usage, req.logprobs, chat=True)
        await run_whole(served, request, ereq, choice)
        message = {"role": "assistant", "content": choice.text}
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": served.name,
            "choices": [{
                "index": 0, "message": message,
                "logprobs": _logprobs_json(True, choice, 0, len(choice.ids)) if req.logprobs else None,
                "finish_reason": finish_reason(choice, served, ereq.max_tokens),
            }],
            "usage": usage(len(ids), choice),
        }

    return app
