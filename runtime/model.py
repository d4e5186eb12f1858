"""Llama-family decoder: RMSNorm, RoPE (default / llama3), GQA, SwiGLU, tied embeddings.

Two ways in, one set of layer maths:
* dense (calibration, accuracy checks): `embed`, `layer_dense`, `logits`,
  `forward_dense` -- causal attention over whole sequences, no cache; an
  observer sees every layer's K (after RoPE, what the cache stores) and V.
* paged (the engine): `forward_paged` runs one flattened batch of tokens --
  decode tokens first, then packed prefill sequences -- writing K/V into the
  paged cache and attending through the selected attention backend.

The numerics follow transformers' LlamaForCausalLM (RMSNorm in fp32 then cast,
RoPE tables in fp32, residuals in the model dtype), which is what the parity
tests check. No scheduling logic lives here.

q/k/v and gate/up projections are fused into one matmul each at load time:
on CPU the per-op overhead, not the FLOPs, dominates small-batch decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .attention import prefill_attention, read_kv, reference_backend, stores_exactly
from .batch_invariant import fast_linear, pack_weight
from .config import ModelConfig
from .errors import InputError
from .kv_cache import LayerCache
from .rope import Rotary, apply_rotary
from .weights import layer_name

Observer = Callable[[int, torch.Tensor, torch.Tensor], None]


class WeightSource(Protocol):
    has_lm_head: bool

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(num_heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


@dataclass
class PagedBatch:
    """One engine step, flattened: the first `num_decode` tokens are decode tokens
    (one per running sequence), the rest are prefill sequences packed back to back."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    num_decode: int
    block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    seq_lens: torch.Tensor  # [num_decode] int32, including the token being decoded
    cu_seqlens: torch.Tensor  # [num_prefill + 1] int32, offsets into the prefill part
    logits_indices: torch.Tensor  # [num_sampled] int64: the last token of every sequence sampled this step
    max_position: int | None = None  # a host-side bound on `positions` (saves a sync per step)
    # chunked prefill: tokens each prefill sequence already has in the cache, and its block table
    # (None when every prefill starts at token 0)
    context_lens: torch.Tensor | None = None  # [num_prefill] int32
    prefill_block_tables: torch.Tensor | None = None  # [num_prefill, max_blocks] int32


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: WeightSource,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        stream_layers: bool = False,
    ):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InputError(f"model dtype {dtype} is not supported; use float32, bfloat16 or float16.")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights = weights
        self.sm_scale = cfg.head_dim**-0.5
        self.rotary = Rotary(cfg)
        self.embed_tokens = weights.get("model.embed_tokens.weight", dtype, self.device)
        self.final_norm = weights.get("model.norm.weight", dtype, self.device)
        tied = cfg.tie_word_embeddings or not weights.has_lm_head
        # matmul weights in the layout the CPU GEMM multiplies fastest (batch_invariant.pack_weight; a tied
        # head then is a packed copy beside the embedding table, which lookups still need plain)
        self.lm_head = pack_weight(self.embed_tokens if tied else weights.get("lm_head.weight", dtype, self.device))
        # Layer streaming (calibration of models larger than memory) keeps one layer resident.
        self.stream_layers = stream_layers
        self._layers: list[LayerWeights] | None = None if stream_layers else [
            self._load_layer(i) for i in range(cfg.num_layers)
        ]
        self._streamed: tuple[int, LayerWeights] | None = None

    # ------------------------------------------------------------ weights
    def _load_layer(self, i: int) -> LayerWeights:
        def get(name: str) -> torch.Tensor:
            return self.weights.get(layer_name(i, name), self.dtype, self.device)

        qkv = torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"])
        gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        return LayerWeights(
            get("input_layernorm.weight"), pack_weight(qkv), pack_weight(get("self_attn.o_proj.weight")),
            get("post_attention_layernorm.weight"), pack_weight(gate_up), pack_weight(get("mlp.down_proj.weight")),
        )

    def layer(self, i: int) -> LayerWeights:
        if self._layers is not None:
            return self._layers[i]
        if self._streamed is None or self._streamed[0] != i:
            self._streamed = None  # drop the previous layer before loading the next
            self._streamed = (i, self._load_layer(i))
        return self._streamed[1]

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed_tokens, self.final_norm]
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        for layer in self._layers or []:
            tensors += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------- pieces
    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, self.cfg.rms_norm_eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * xf.to(x.dtype)

    def _qkv(self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lin=fast_linear):
        """h [T, hidden] -> q [T, heads, D], k, v [T, kv_heads, D], RoPE applied to q and k.
        lin: the matmul (batch_invariant.linear in the batch-invariant mode)."""
        c = self.cfg
        t = h.shape[0]
        qkv = lin(self._rms_norm(h, layer.input_norm), layer.qkv)
        heads = c.num_heads + c.num_kv_heads
        # q and k side by side take RoPE as one tensor: half the small ops of a decode step's layer
        qk = apply_rotary(qkv[:, : heads * c.head_dim].view(t, heads, c.head_dim), cos, sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], 1)
        if q.is_cuda:  # the Triton kernels take q and k with whole rows of heads
            q, k = q.contiguous(), k.contiguous()
        return q, k, qkv[:, heads * c.head_dim:].view(t, c.num_kv_heads, c.head_dim)

    def _finish_layer(self, layer: LayerWeights, h: torch.Tensor, attn: torch.Tensor, lin=fast_linear) -> torch.Tensor:
        h = h + lin(attn.reshape(h.shape[0], -1), layer.o)
        gate, up = lin(self._rms_norm(h, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
        return h + lin(F.silu(gate) * up, layer.down)

    # -------------------------------------------------------------- dense
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] or [B, T] -> h [..., hidden] in the model dtype."""
        return F.embedding(ids.to(self.device), self.embed_tokens)

    def layer_dense(
        self, i: int, h: torch.Tensor, positions: torch.Tensor | None = None, observer: Observer | None = None
    ) -> torch.Tensor:
        """One decoder layer over whole sequences, causal. h [T, hidden] or [B, T, hidden];
        positions [T] (shared by the batch), default 0..T-1."""
        shape = h.shape
        seq = shape[-2]
        batch = h.numel() // (seq * shape[-1])
        if positions is None:
            positions = torch.arange(seq, device=h.device)
        pos = positions.to(h.device).long().repeat(batch)
        cos, sin = self.rotary.cos_sin(pos, self.dtype)
        flat = h.reshape(batch * seq, shape[-1])
        layer = self.layer(i)
        q, k, v = self._qkv(layer, flat, cos, sin)
        if observer is not None:
            # An observer may return (k, v) to replace them: the accuracy checks pass K/V
            # through a quantize/dequantize round trip here (what a quantized cache stores).
            replaced = observer(i, k.to(torch.float32), v.to(torch.float32))
            if replaced is not None:
                k, v = (x.to(k.dtype) for x in replaced)
        cu = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32)
        attn = prefill_attention(q, k, v, cu, self.sm_scale)
        # Accuracy checks compare each layer's attention output with and without quantized KV.
        attention_hook = getattr(observer, "observe_attention", None)
        if attention_hook is not None:
            attention_hook(i, attn.to(torch.float32))
        return self._finish_layer(layer, flat, attn).reshape(shape)

    def logits(self, h: torch.Tensor, lin=fast_linear) -> torch.Tensor:
        """Final norm + LM head; fp32 logits. h [..., hidden] (dense callers pass [B, T, hidden])."""
        return lin(self._rms_norm(h, self.final_norm), self.lm_head).to(torch.float32)

    @torch.inference_mode()
    def forward_dense(self, ids: torch.Tensor, observer: Observer | None = None) -> torch.Tensor:
        """ids [T] or [B, T] -> logits [..., T, vocab] (fp32), causal, no cache."""
        h = self.embed(ids)
        for i in range(self.cfg.num_layers):
            h = self.layer_dense(i, h, observer=observer)
        return self.logits(h)

    # -------------------------------------------------------------- paged
    def _prefill(self, ops, q, k, v, cache: LayerCache, batch: PagedBatch) -> torch.Tensor:
        """The prefill part's attention: over the prompt alone, or (chunked prefill) also over the
        earlier chunks already in the cache. Write, then read: the step's K/V are already in the
        cache, and the prompt attends to them as stored (read_kv), as decode and later chunks will,
        so chunk boundaries -- which depend on the other requests of a step -- change no value."""
        if not stores_exactly(cache.fmt, k.dtype):
            k, v = read_kv(cache, batch.slot_mapping[batch.num_decode:], k.dtype)
        if batch.context_lens is None:
            return ops.prefill_attention(q, k, v, batch.cu_seqlens, self.sm_scale)
        return ops.prefill_context_attention(q, k, v, batch.cu_seqlens, cache, batch.prefill_block_tables,
                                             batch.context_lens, self.sm_scale)

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, caches: list[LayerCache], backend=None) -> torch.Tensor:
        """Logits [num_sequences, vocab] (fp32) for the last token of every sequence in the step."""
        ops = backend or reference_backend()
        lin = getattr(ops, "linear", fast_linear)  # the batch-invariant backend brings its own
        nd = batch.num_decode
        h = self.embed(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, self.dtype, batch.max_position)
        has_prefill = h.shape[0] > nd
        for i in range(self.cfg.num_layers):
            layer = self.layer(i)
            q, k, v = self._qkv(layer, h, cos, sin, lin)
            ops.write_kv(caches[i], k, v, batch.slot_mapping)
            if nd and not has_prefill:
                attn = ops.decode_attention(q, caches[i], batch.block_tables, batch.seq_lens, self.sm_scale)
            elif not nd:
                attn = self._prefill(ops, q, k, v, caches[i], batch)
            else:
                attn = torch.cat((
                    ops.decode_attention(q[:nd], caches[i], batch.block_tables, batch.seq_lens, self.sm_scale),
                    self._prefill(ops, q[nd:], k[nd:], v[nd:], caches[i], batch),
                ))
            h = self._finish_layer(layer, h, attn, lin)
        return self.logits(h[batch.logits_indices], lin)
