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

import functools
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
from .rotation import NO_ROTATION, KVRotation, fold_o_proj, fold_v_proj
from .weights import layer_name

Observer = Callable[[int, torch.Tensor, torch.Tensor], None]


@functools.cache
def _cuda_rms_norm():
    """runtime/kernels/small_ops.rms_norm, imported on first use: the kernel tests choose the Triton interpreter
    before any kernel module is imported."""
    from .kernels.small_ops import rms_norm

    return rms_norm


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
        rotation: KVRotation = NO_ROTATION,
    ):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InputError(f"model dtype {dtype} is not supported; use float32, bfloat16 or float16.")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights = weights
        self.sm_scale = cfg.head_dim**-0.5
        # the attention heads this model instance computes: all of them, or a tensor-parallel
        # rank's share (runtime/parallel/tp_model.py)
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        # o and down accumulate in float64 and round once, so a tensor-parallel split of their sums
        # gives the bits one device gives (runtime/parallel/; the engine's `tp_invariant`)
        self.exact_row_sums = False
        self.rotary = Rotary(cfg)
        # KV rotation (runtime/rotation.py): q and k rotated after RoPE, V's rotation folded into v/o_proj.
        self.rotation = rotation
        rotation.check(cfg.head_dim)
        self._rot64 = rotation.matrix(cfg.head_dim, torch.float64) if rotation.active else None
        # as a linear layer's weight (x @ M = linear(x, M^T)), so the batch-invariant mode's GEMM rotates too
        self.rotation_weight = None if self._rot64 is None else self._rot64.T.contiguous().to(self.device, dtype)
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
        def get(name: str, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return self.weights.get(layer_name(i, name), dtype, self.device)

        if self._rot64 is None:
            v, o = get("self_attn.v_proj.weight"), get("self_attn.o_proj.weight")
        else:  # folded in fp64 from the stored weights, then rounded once to the model dtype
            m = self._rot64.to(self.device)
            v = fold_v_proj(get("self_attn.v_proj.weight", torch.float32), m).to(self.dtype)
            o = fold_o_proj(get("self_attn.o_proj.weight", torch.float32), m).to(self.dtype)
        qkv = torch.cat([get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), v])
        gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        return LayerWeights(
            get("input_layernorm.weight"), pack_weight(qkv), pack_weight(o),
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
        if x.is_cuda:  # the fused step's norm kernel: fused and unfused steps share one reduction, and its bits
            return _cuda_rms_norm()(x, w, self.cfg.rms_norm_eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, self.cfg.rms_norm_eps)
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return w * xf.to(x.dtype)

    def _qkv(self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lin=fast_linear):
        """h [T, hidden] -> q [T, heads, D], k, v [T, kv_heads, D], RoPE applied to q and k.
        lin: the matmul (batch_invariant.linear in the batch-invariant mode)."""
        return self.rope(lin(self._rms_norm(h, layer.input_norm), layer.qkv), cos, sin, lin)

    def rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lin=fast_linear):
        """The fused QKV matmul's output [T, (heads + 2 kv_heads) D] -> q, k (rotated), v."""
        d = self.cfg.head_dim
        t = qkv.shape[0]
        heads = self.num_heads + self.num_kv_heads
        # q and k side by side take RoPE (and the KV rotation) as one tensor: half the small ops of a
        # decode step's layer
        qk = apply_rotary(qkv[:, : heads * d].view(t, heads, d), cos, sin)
        if self.rotation_weight is not None:  # one GEMM over the step's q and k rows, never over the cache
            qk = lin(qk.reshape(t * heads, d), self.rotation_weight).view(t, heads, d)
        q, k = qk.split([self.num_heads, self.num_kv_heads], 1)
        if q.is_cuda:  # the Triton kernels take q and k with whole rows of heads
            q, k = q.contiguous(), k.contiguous()
        return q, k, qkv[:, heads * d:].view(t, self.num_kv_heads, d)

    def _finish_layer(self, layer: LayerWeights, h: torch.Tensor, attn: torch.Tensor, lin=fast_linear) -> torch.Tensor:
        h = h + self._row_linear(attn.reshape(h.shape[0], -1), layer.o, lin)
        gate, up = lin(self._rms_norm(h, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
        return h + self._row_linear(F.silu(gate) * up, layer.down, lin)

    def _row_linear(self, x: torch.Tensor, w: torch.Tensor, lin) -> torch.Tensor:
        """A matmul whose input dim tensor parallelism splits (o, down): each rank's partial, summed.
        exact_row_sums: the partials in float64 (products of two 32-bit floats are exact there), so
        how the sum is split and ordered is lost in the final rounding; a quantized KV cache would
        otherwise turn the last-bit differences of another split into other codes."""
        if self.exact_row_sums:
            w = w.to_dense() if w.is_mkldnn else w  # a CPU weight packed for oneDNN (batch_invariant.pack_weight)
            return self._reduce(F.linear(x.double(), w.double())).to(x.dtype)
        return self._reduce(lin(x, w))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over tensor-parallel ranks of a row-parallel matmul's partial output; one rank holds
        the whole sum already (runtime/parallel/tp_model.py all-reduces)."""
        return x

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
        so chunk boundaries -- which depend on the other requests of a step -- change no value. A backend
        with `prefill_from_cache` (the batch-invariant mode's on CUDA) reads the step's K/V from the pages itself."""
        from_cache = getattr(ops, "prefill_from_cache", None)
        if from_cache is not None:
            return from_cache(q, cache, batch, self.sm_scale)
        per_channel = cache.fmt.per_channel_keys
        if not stores_exactly(cache.fmt, k.dtype):
            stored_k, v = read_kv(cache, batch.slot_mapping[batch.num_decode:], k.dtype)
            # per-channel keys: a query reads its own block's keys in fp16, the attention rounds them itself
            k = k if per_channel else stored_k
        if batch.context_lens is None and not per_channel:
            return ops.prefill_attention(q, k, v, batch.cu_seqlens, self.sm_scale)
        context = batch.context_lens if batch.context_lens is not None else \
            torch.zeros(batch.cu_seqlens.numel() - 1, dtype=torch.int32)
        return ops.prefill_context_attention(q, k, v, batch.cu_seqlens, cache, batch.prefill_block_tables,
                                             context, self.sm_scale)

    def _attend(self, ops, q, k, v, cache: LayerCache, batch: PagedBatch) -> torch.Tensor:
        """Write the step's K/V, then attend: decode rows through the cache, prefill rows (`_prefill`)."""
        nd = batch.num_decode
        ops.write_kv(cache, k, v, batch.slot_mapping)
        if nd and q.shape[0] == nd:
            return ops.decode_attention(q, cache, batch.block_tables, batch.seq_lens, self.sm_scale)
        if not nd:
            return self._prefill(ops, q, k, v, cache, batch)
        return torch.cat((
            ops.decode_attention(q[:nd], cache, batch.block_tables, batch.seq_lens, self.sm_scale),
            self._prefill(ops, q[nd:], k[nd:], v[nd:], cache, batch),
        ))

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, caches: list[LayerCache], backend=None) -> torch.Tensor:
        """Logits [num_sequences, vocab] (fp32) for the last token of every sequence in the step."""
        ops = backend or reference_backend()
        lin = getattr(ops, "linear", fast_linear)  # the batch-invariant backend brings its own
        small = getattr(ops, "small_ops", None)  # fused Triton small ops (runtime/kernels/small_ops.py)
        if small is not None:
            return self._forward_paged_small_ops(batch, caches, ops, small, lin)
        h = self.embed(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, self.dtype, batch.max_position)
        for i in range(self.cfg.num_layers):
            layer = self.layer(i)
            q, k, v = self._qkv(layer, h, cos, sin, lin)
            attn = self._attend(ops, q, k, v, caches[i], batch)
            h = self._finish_layer(layer, h, attn, lin)
        return self.logits(h[batch.logits_indices], lin)

    def _forward_paged_small_ops(self, batch: PagedBatch, caches: list[LayerCache], ops, small, lin) -> torch.Tensor:
        """forward_paged with every residual add fused into the next RMSNorm, RoPE into one kernel that also
        lays q and k out for attention, and SwiGLU into one: the same maths and roundings as the torch ops
        (runtime/kernels/small_ops.py), three kernels per layer in place of about thirty."""
        c = self.cfg
        eps = c.rms_norm_eps
        cos_t, sin_t = self.rotary.table_for(batch.positions, batch.max_position)
        h, normed = small.add_rms_norm(self.embed(batch.input_ids), None, self.layer(0).input_norm, eps)
        heads_d = (c.num_heads + c.num_kv_heads) * c.head_dim
        for i in range(c.num_layers):
            layer = self.layer(i)
            qkv = lin(normed, layer.qkv)
            q, k = small.rope_qk(qkv, cos_t, sin_t, batch.positions, c.num_heads, c.num_kv_heads, c.head_dim)
            if self.rotation_weight is not None:  # the KV rotation, as the unfused path applies it after RoPE
                q, k = (lin(x.reshape(-1, c.head_dim), self.rotation_weight).view_as(x) for x in (q, k))
            v = qkv[:, heads_d:].view(-1, c.num_kv_heads, c.head_dim)
            attn = self._attend(ops, q, k, v, caches[i], batch)
            h, normed = small.add_rms_norm(h, lin(attn.reshape(h.shape[0], -1), layer.o), layer.post_norm, eps)
            down = lin(small.swiglu(lin(normed, layer.gate_up)), layer.down)
            nxt = self.layer(i + 1).input_norm if i + 1 < c.num_layers else self.final_norm
            h, normed = small.add_rms_norm(h, down, nxt, eps)
        return lin(normed[batch.logits_indices], self.lm_head).to(torch.float32)
