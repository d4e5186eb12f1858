"""Quantized KV on the dense model path: a simulation of the engine, kept as a cross-check.

The evaluate stage scores through the engine itself (`Engine.score`); tests
compare it with this simulation (same metric functions: `DenseScorer.score`
has Engine.score's contract).

`KVRoundTrip` is an observer for runtime.model.LlamaModel.layer_dense that
returns K and V after a quantize -> dequantize round trip with the engine's
format and scales (static per_tensor / per_head scales, or dynamic per-token
scales computed by runtime.kv_format exactly as the cache write does). The
layer then attends to the dequantized values: numerically what the paged
engine computes when a token attends to quantized KV, up to the rounding of
a different attention kernel.

`DenseScorer` wraps the model: logits for whole sequences, with or without the
round trip. accuracy.json names this path "dense-kv-roundtrip".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.errors import InputError
from runtime.kv_format import KVFormat
from runtime.kv_quant import dequantize, quantize, quantize_dynamic
from runtime.scoring import TokenScores

PATH_NAME = "dense-kv-roundtrip"


class KVRoundTrip:
    """Observer replacing K/V by dequantize(quantize(x)) for one KV format."""

    def __init__(self, fmt: KVFormat, num_layers: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None):
        if not fmt.quantized:
            raise InputError(f"{fmt.name} is not a quantized KV format; use the baseline instead.")
        if fmt.static:
            if k_scale is None or v_scale is None:
                raise InputError(f"{fmt.name} needs calibrated k/v scales; run `kvq calibrate` first.")
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if s.shape[0] != num_layers or (fmt.granularity == "per_head") != (s.dim() == 2):
                    raise InputError(
                        f"{name} has shape {list(s.shape)}, which does not fit {fmt.name} on a "
                        f"{num_layers}-layer model; re-run `kvq calibrate` for this model."
                    )
        self.fmt = fmt
        self.k_scale = None if k_scale is None else k_scale.to(torch.float32)
        self.v_scale = None if v_scale is None else v_scale.to(torch.float32)

    def _roundtrip(self, x: torch.Tensor, which: str, scales: torch.Tensor | None, layer: int) -> torch.Tensor:
        fmt = self.fmt.side(which)  # K and V may be stored differently (K8V4): each side rounds by its own format
        if fmt.dynamic:
            q, s, z = quantize_dynamic(x, fmt)
            return dequantize(q, fmt, s, z)
        s = scales[layer].to(x.device)  # [] per_tensor, [kv_heads] per_head: broadcasts over [T, H]
        return dequantize(quantize(x, fmt, s), fmt, s)

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self._roundtrip(k, "k", self.k_scale, layer), self._roundtrip(v, "v", self.v_scale, layer)


@dataclass
class DenseScorer:
    """Whole-sequence logits from the runtime model, optionally with quantized KV."""

    model: object  # runtime.model.LlamaModel
    kv: KVRoundTrip | None = None  # None: unquantized KV (the baseline)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """ids [T] or [B, T] -> fp32 logits [..., T, vocab], or of the `last` positions only
        (the LM head over a 49k vocabulary costs as much as several layers)."""
        h = self.model.embed(ids)
        for i in range(self.model.cfg.num_layers):
            h = self.model.layer_dense(i, h, observer=self.kv)
        return self.model.logits(h if last is None else h[..., -last:, :])

    @torch.inference_mode()
    def score(self, sequences, start: int | list[int] = 1, on_pass=None) -> list[TokenScores]:
        """Engine.score's contract on the dense path: one forward per sequence."""
        starts = [start] * len(sequences) if isinstance(start, int) else list(start)
        out = []
        for ids, s in zip(sequences, starts):
            ids = torch.as_tensor(ids, dtype=torch.int64)
            logits = self.logits(ids, last=ids.numel() - s + 1)[:-1]
            lp = logits.gather(-1, ids[s:, None].to(logits.device)).squeeze(-1) - torch.logsumexp(logits, -1)
            out.append(TokenScores(s, lp.cpu(), logits.argmax(-1).cpu()))
            if on_pass is not None:
                on_pass(ids.numel())
        return out

    @torch.inference_mode()
    def token_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """log p(ids[t] | ids[:t]) for t >= 1: [..., T-1] fp32."""
        logp = torch.log_softmax(self.logits(ids)[..., :-1, :], dim=-1)
        return logp.gather(-1, ids[..., 1:].unsqueeze(-1).to(logp.device)).squeeze(-1)
