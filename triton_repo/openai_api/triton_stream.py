"""The frontend's side of Triton: discover the engine model, stream one request over gRPC.

The frontend talks to the engine model (`kvq_engine`, or `tensorrt_llm` in a
TensorRT-LLM repository) rather than to the ensemble: tritonserver 2.51 does
not pass an ensemble request's cancellation on to its composing models, and a
client that hangs up must free its engine request. The frontend tokenizes
itself (with the deployment's own tokenizer, read from the preprocessing
model's config), which also gives exact token counts for `usage` and chat
templates over whole conversations. Inputs keep TensorRT-LLM's names
(input_ids, request_output_len, runtime_top_p, random_seed, return_log_probs,
...), so the same code drives either engine model.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import InputError, RequestError, ServerError

from .. import protocol

# Triton dtype -> numpy dtype for the engine inputs the frontend sends (no strings: it sends token ids).
_NP = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_}
ENGINE_MODELS = (protocol.ENGINE_MODEL, protocol.TRTLLM_MODEL)
ENGINE_FAILURE = "the engine failed"  # kvq_engine's message when its step loop fails a request


@dataclass(frozen=True)
class EngineModel:
    """What the frontend learned about the deployment at startup."""

    name: str
    inputs: dict[str, str]  # input name -> Triton dtype
    batched: bool  # max_batch_size > 0: every tensor carries a leading batch dim of 1
    cumulative: bool  # responses resend every id so far (kvq_engine's prev_length), else only new ids
    tokenizer_dir: Path
    limits: protocol.EngineLimits | None  # from engine.json where the engine dir has one

    def supports(self, name: str) -> bool:
        return name in self.inputs


def discover(grpc_url: str, timeout_s: float = 30.0) -> EngineModel:
    """Read the engine model's config and the tokenizer location from a ready server (blocking)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True).get("models", [])}
        name = next((n for n in ENGINE_MODELS if index.get(n, {}).get("state") == "READY"), None)
        if name is None:
            raise ServerError(
                f"the server at {grpc_url} has no ready engine model ({' or '.join(ENGINE_MODELS)}); "
                f"models: {sorted(index)}. Serve a repository written by `kvq deploy`."
            )
        cfg = client.get_model_config(name, as_json=True, client_timeout=timeout_s)["config"]
        pre = client.get_model_config(protocol.PREPROCESSING, as_json=True, client_timeout=timeout_s)["config"]
    except InferenceServerException as e:
        raise ServerError(f"cannot read the deployment at {grpc_url}: {e}; is `kvq serve` running there?") from e
    finally:
        client.close()
    params = {k: v.get("string_value", "") for k, v in pre.get("parameters", {}).items()}
    if not params.get("tokenizer_dir"):
        raise InputError(
            f"{protocol.PREPROCESSING} at {grpc_url} names no tokenizer_dir; redeploy with `kvq deploy`."
        )
    engine_params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    limits = None
    engine_dir = engine_params.get("engine_dir")
    if engine_dir and Path(engine_dir, "engine.json").is_file():
        limits = protocol.EngineLimits.from_engine_dir(engine_dir)
    return EngineModel(
        name=name,
        inputs={t["name"]: t["data_type"].removeprefix("TYPE_") for t in cfg.get("input", [])},
        batched=int(cfg.get("max_batch_size", 0)) > 0,
        cumulative=any(t["name"] == "prev_length" for t in cfg.get("output", [])),
        tokenizer_dir=Path(params["tokenizer_dir"]),
        limits=limits,
    )


@dataclass
class EngineRequest:
    """One generation, in the engine model's own input names (TensorRT-LLM's)."""

    input_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None = None
    seed: int | None = None
    logprobs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # further engine inputs (penalties, ...)

    def tensors(self, model: EngineModel) -> dict[str, np.ndarray]:
        values: dict[str, Any] = {
            "request_output_len": self.max_tokens,
            "temperature": self.temperature,
            "runtime_top_p": self.top_p,
            "streaming": True,
            **self.extra,
        }
        if self.top_k is not None:
            values["runtime_top_k"] = self.top_k
        if self.seed is not None:
            values["random_seed"] = self.seed
        if self.logprobs:
            values["return_log_probs"] = True
        out = {
            "input_ids": np.array([self.input_ids], dtype=np.int32),
            "input_lengths": np.array([[len(self.input_ids)]], dtype=np.int32),
        }
        for name, value in values.items():
            if name not in model.inputs:
                raise RequestError(f"the engine model {model.name} has no input {name}; leave the field out.")
            out[name] = np.array([[value]], dtype=_NP[model.inputs[name]])
        if not model.batched:
            out = {k: v[0] for k, v in out.items()}
        return out


@dataclass
class TokenStep:
    """What one engine response adds: new token ids (and their log probabilities when asked)."""

    ids: list[int]
    logprobs: list[float] | None
    final: bool


def _infer_request(model: EngineModel, req: EngineRequest):
    from tritonclient.grpc import service_pb2

    msg = service_pb2.ModelInferRequest(model_name=model.name, id=uuid.uuid4().hex)
    for name, arr in req.tensors(model).items():
        t = msg.inputs.add()
        t.name, t.datatype = name, model.inputs.get(name, "INT32")
        t.shape.extend(arr.shape)
        msg.raw_input_contents.append(np.ascontiguousarray(arr).tobytes())
    # kvq_engine closes a stream whose tokens were all sent with a flags-only response: ask to see it.
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


class TritonStreams:
    """gRPC streaming to the engine model from the frontend's event loop (grpc.aio)."""

    def __init__(self, grpc_url: str, model: EngineModel):
        self.grpc_url, self.model = grpc_url, model
        self._channel = None
        self._stub = None

    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        # Large limits: a long prompt's ids and a long answer's cumulative ids travel in one message.
        opts = [("grpc.max_send_message_length", 2**30), ("grpc.max_receive_message_length", 2**30)]
        self._channel = grpc.aio.insecure_channel(self.grpc_url, options=opts)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenStep]:
        """Yield the engine's token responses. Leaving the loop early (a stop string, a client that
        went away, a cancelled task) cancels the gRPC call, and with it the engine request."""
        import grpc
        from tritonclient.grpc import InferResult

        done = asyncio.Event()
        request = _infer_request(self.model, req)

        async def requests():
            yield request
            await done.wait()  # half-closing early could end the stream before the last response

        call = self._stub.ModelStreamInfer(requests())
        seen = 0
        try:
            async for resp in call:
                if resp.error_message:
                    raise RequestError(resp.error_message)
                final = resp.infer_response.parameters["triton_final_response"].bool_param
                result = InferResult(resp.infer_response)
                ids_arr = result.as_numpy("output_ids")
                ids: list[int] = []
                lps = None
                if ids_arr is not None:
                    got = ids_arr.reshape(-1).tolist()
                    ids = got[seen:] if self.model.cumulative else got
                    lp = result.as_numpy("output_log_probs") if req.logprobs else None
                    if lp is not None:
                        lp = lp.reshape(-1).tolist()
                        lps = lp[len(lp) - len(ids) :] if len(lp) >= len(ids) else None
                    seen += len(ids) if self.model.cumulative else 0
                yield TokenStep(ids, lps, final)
                if final:
                    return
            raise ServerError(f"the stream from {self.grpc_url} ended before the final response.")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                raise asyncio.CancelledError() from e
            raise ServerError(f"Triton at {self.grpc_url} failed the stream ({e.code().name}): {e.details()}") from e
        finally:
            done.set()
            call.cancel()


def engine_error_is_internal(message: str) -> bool:
    """Errors Triton returns for a request are the request's fault, except the engine failing it."""
    return ENGINE_FAILURE in message


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
