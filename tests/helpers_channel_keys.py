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


def oracle_attention(q, k, v, p: int, sm_scale: float, operand: torch.dtype | None = None,
                     pre: float = 1.0, pre_codes: np.ndarray | float | None = None) -> np.ndarray:
    """fp64: query q [heads, D] at position p over keys/values [0, p] [T, kv_heads, D]: its own block's keys in
    fp16, every earlier block's quantized by the rule; V exact (the test's values are exact in int4 per token).

    operand: the dtype a kernel rounds its score operands to (None: none), with its prescale `pre`: a quantized
    block's score is then sum_c rnd(q_c s_c pre_c) code_c / pre_c + q . zero (the kernels fold the scales into q;
    pre_codes: the prescale of each channel there, default `pre`) and the own block's sum_c rnd(q_c pre) rnd(k_c) /
    pre, computed here from the same rounded values."""
    pre_codes = np.broadcast_to(np.asarray(pre if pre_codes is None else pre_codes, np.float64), (q.shape[-1],))
    k16 = k.to(torch.float16)
    own = p // BLOCK * BLOCK
    g = q.shape[0] // k.shape[1]
    q32 = q.float()

    def rnd(x: torch.Tensor) -> np.ndarray:  # fp32 products rounded as the kernel's operands
        return (x.to(operand) if operand is not None else x).double().numpy()

    scores = np.empty((q.shape[0], p + 1))
    for b0 in range(0, own, BLOCK):
        blk = k16[b0:b0 + BLOCK].double().numpy().transpose(1, 0, 2)  # [H, 64, D]
        codes, s, zero, _ = oracle_block(blk)
        for head in range(q.shape[0]):
            qs = rnd(q32[head] * torch.from_numpy(s[head // g] * pre_codes).float())
            scores[head, b0:b0 + BLOCK] = codes[head // g] @ (qs / pre_codes) + zero[head // g] @ q32[head].double().numpy()
    kown = rnd(k16[own:p + 1].float())  # [n, H, D]
    for head in range(q.shape[0]):
        scores[head, own:] = kown[:, head // g] @ rnd(q32[head] * pre) / pre
    vd = v[: p + 1].double().numpy()
    out = np.empty(q.shape)
    for head in range(q.shape[0]):
        w = np.exp((scores[head] - scores[head].max()) * sm_scale)
        out[head] = (w / w.sum()) @ vd[:, head // g]
    return out


def output_bound(q, v, n: int, sm_scale: float, u_operands: float, span: float, u_out: float) -> float:
    """How far a kernel's output may lie from `oracle_attention` computed with the kernel's score operands: its fp32
    sums (D + 4 roundings in a score whose terms add up to at most `span` in magnitude, n + 4 in an output) move
    the softmax weights by a factor within exp(+-2 ds), the value operands p * s_v round once more (u_operands) and
    the output to its dtype (u_out): (exp(2 ds) - 1 + u_operands + u_out + (n + 4) 2^-24) max|v|."""
    u32 = 2.0**-24
    ds = (q.shape[-1] + 4) * u32 * sm_scale * span
    return (np.exp(2 * ds) - 1 + u_operands + u_out + (n + 4) * u32) * v[:n].abs().max().item()


def score_span(q, k, n: int) -> float:
    """A bound on sum_c |q_c s_c code_c| + sum_c |q_c z_c| over the first n keys: sum_c |q_c| 2 max_t |k_tc|
    (s code = k - z and z both lie within the block's range)."""
    kmax = k[:n].abs().double().amax(0).repeat_interleave(q.shape[0] // k.shape[1], 0)  # [heads, D]
    return (q.abs().double() * 2 * kmax).sum(-1).max().item()


def exact_int4_values(seed: int, shape) -> torch.Tensor:
    """V that int4 per-token asym stores exactly: per token-head, zero + q * s with fp16 s and zero, q in 0..15
    with both ends present."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, shape, generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    s = torch.tensor(0.125) * (1 + torch.randint(0, 4, shape[:-1], generator=g)).float()
    return q * s[..., None] - 0.5
