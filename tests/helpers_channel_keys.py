"""The per-channel-key (KIVI) format's rule and attention in fp64: the oracles of tests/test_channel_keys.py and
tests/test_kernel_channel_keys.py."""

from __future__ import annotations

import numpy as np
import torch

from runtime.kv_format import PER_CHANNEL_TOKENS, format_from_name

NAME = "k.int4-per_channel-asym+v.int4-per_token-asym"
FMT = format_from_name(NAME)
BLOCK = PER_CHANNEL_TOKENS


def fp16_up(x: np.ndarray) -> np.ndarray:
    """Smallest fp16 >= x, elementwise, in fp64."""
    r = x.astype(np.float16)
    r = np.where(r.astype(np.float64) < x, np.nextafter(r, np.float16(np.inf)), r)
    return r.astype(np.float64)


def fp16_down(x: np.ndarray) -> np.ndarray:
    r = x.astype(np.float16)
    r = np.where(r.astype(np.float64) > x, np.nextafter(r, np.float16(-np.inf)), r)
    return r.astype(np.float64)


def oracle_block(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule in fp64 for x [..., 64, D]: (codes, scale, zero) with zero = min rounded down to fp16, s = (max -
    zero) / 15 rounded up to fp16, q = clamp(round half even((x - zero) / s), 0, 15)."""
    zero = fp16_down(x.min(-2))
    s = fp16_up(np.maximum((x.max(-2) - zero) / 15, 2.0**-14))  # never zero: fp16's smallest normal
    y = (x - zero[..., None, :]) / s[..., None, :]
    return np.clip(np.round(y), 0, 15), s, zero, y


def keys(seed: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 30  # an outlier channel, as RoPE'd keys have
    x[..., 5] = 0.25  # a constant channel: max == min
    return x


def oracle_attention(q, k, v, p: int, sm_scale: float) -> np.ndarray:
    """fp64: query q [heads, D] at position p over keys/values [0, p] [T, kv_heads, D]: its own block's keys in
    fp16, every earlier block's quantized by the rule; V exact (the test's values are exact in int4 per token)."""
    k16 = k.to(torch.float16).double().numpy()
    own = p // BLOCK * BLOCK
    kd = k16[: p + 1].copy()
    for b0 in range(0, own, BLOCK):
        blk = k16[b0:b0 + BLOCK].transpose(1, 0, 2)  # [H, 64, D]
        codes, s, zero, _ = oracle_block(blk)
        kd[b0:b0 + BLOCK] = (codes * s[:, None, :] + zero[:, None, :]).transpose(1, 0, 2)
    g = q.shape[0] // k.shape[1]
    qd, vd = q.double().numpy(), v[: p + 1].double().numpy()
    out = np.empty_like(qd)
    for head in range(q.shape[0]):
        s = kd[:, head // g] @ qd[head] * sm_scale
        w = np.exp(s - s.max())
        out[head] = (w / w.sum()) @ vd[:, head // g]
    return out


def exact_int4_values(seed: int, shape) -> torch.Tensor:
    """V that int4 per-token asym stores exactly: per token-head, zero + q * s with fp16 s and zero, q in 0..15
    with both ends present."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, shape, generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    s = torch.tensor(0.125) * (1 + torch.randint(0, 4, shape[:-1], generator=g)).float()
    return q * s[..., None] - 0.5
