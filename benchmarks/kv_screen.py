"""Screen 4-bit (and lower) KV storage rules in the dense simulation before building them into the engine.

Each candidate is a rule for K and one for V (x [tokens, kv_heads, head_dim] -> the values the cache would give
back), optionally with the first `sink` positions of every sequence kept at INT8 per token (attention sinks).
Rules: any runtime.kv_format per-token format; `clip`: symmetric INT4 groups whose scale is alpha * amax / 7,
alpha chosen per group from a few candidates by the smallest squared error (computed at write time);
`nf4`: the 16 NormalFloat levels (QLoRA) times the group's fp16 absmax; `kivi`: keys quantized per channel over
groups of 32 tokens (asymmetric INT4, or `-b<bits>`, fp16 scale and zero), the last incomplete group kept in full
precision, as KIVI's residual window does; `asym-b<bits>-g<group>`: per-token asymmetric integers of any width; `mse:<format>`: a per-token or group-scaled format whose scale is
alpha * amax / qmax with alpha, per token-head (or group), the one of MSE_ALPHAS that gives the smallest squared
error (alpha < 1 clips the largest values, alpha > 1 moves FP8's grid within an octave). Perplexity on the built-in held-out split (and --ood: the out-of-domain text)
through calibration.kvsim.DenseScorer, the same windows as the evaluate stage.

    python -m benchmarks.kv_screen --model-dir DIR --ppl-tokens 4096 [--only a,b@0-5] [--ood] [--device cuda] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from calibration.files import write_json_atomic
from calibration.kvsim import DenseScorer
from calibration.loading import load_model, load_tokenizer
from calibration.perplexity import eval_windows, perplexity
from runtime.kv_format import KVFormat, format_from_name
from runtime.kv_quant import dequantize, dynamic_scales, quantize, quantize_dynamic, round_down_to, round_up_to
from runtime.rotation import NO_ROTATION, KVRotation

HADAMARD = KVRotation("hadamard", 0)
OUT_OF_DOMAIN = str(Path(__file__).resolve().parents[1] / "calibration" / "data" / "out_of_domain")
# NormalFloat-4 levels (Dettmers et al., QLoRA): quantiles of N(0, 1) scaled to [-1, 1], an exact zero
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
CLIP_ALPHAS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
MSE_ALPHAS = (0.8, 0.85, 0.9, 0.95, 1.0) + tuple(2 ** (k / 8) for k in range(1, 8))


def format_rule(fmt: KVFormat):
    def rule(x: torch.Tensor) -> torch.Tensor:
        q, s, z = quantize_dynamic(x, fmt)
        return dequantize(q, fmt, s, z)
    return rule


def mse_scale_rule(fmt: KVFormat, alphas=MSE_ALPHAS):
    """fmt's dynamic scale times the alpha of `alphas` with the smallest squared error, per token-head or group."""
    sd = fmt.scale_torch_dtype

    def rule(x: torch.Tensor) -> torch.Tensor:
        s0, _ = dynamic_scales(x, fmt)
        best, best_err = None, None
        for a in alphas:
            s = round_up_to(s0.float() * a, sd)
            y = dequantize(quantize(x, fmt, s), fmt, s)
            d, g = (y - x).pow(2), fmt.group_size
            # each element carries its token-head's (or group's) squared error, so where() picks whole groups
            err = _groups(d, g).sum(-1).repeat_interleave(g, -1) if g else d.sum(-1, keepdim=True)
            if best is None:
                best, best_err = y, err
            else:
                take = err < best_err
                best, best_err = torch.where(take, y, best), torch.minimum(err, best_err)
        return best
    return rule


def _groups(x: torch.Tensor, g: int) -> torch.Tensor:
    return x.unflatten(-1, (x.shape[-1] // g, g))


def clip_rule(group: int):
    """Symmetric INT4 with a searched clip: scale = round_up_fp16(alpha * amax / 7), best alpha per group."""
    def rule(x: torch.Tensor) -> torch.Tensor:
        xg = _groups(x, group)
        amax = xg.abs().amax(-1, keepdim=True).clamp_min(1e-8)
        best, best_err = None, None
        for a in CLIP_ALPHAS:
            s = round_up_to(a * amax / 7, torch.float16).float()
            y = torch.round(xg / s).clamp(-7, 7) * s
            err = (y - xg).pow(2).sum(-1, keepdim=True)
            if best is None:
                best, best_err = y, err
            else:
                take = err < best_err
                best, best_err = torch.where(take, y, best), torch.minimum(err, best_err)
        return best.flatten(-2)
    return rule


def nf4_rule(group: int):
    """NF4 levels times the group's absmax (stored fp16, rounded up): 4 + 16/group bits per element."""
    def rule(x: torch.Tensor) -> torch.Tensor:
        xg = _groups(x, group)
        amax = round_up_to(xg.abs().amax(-1, keepdim=True).clamp_min(1e-8), torch.float16).float()
        levels = NF4.to(x.device)
        idx = ((xg / amax).unsqueeze(-1) - levels).abs().argmin(-1)
        return (levels[idx] * amax).flatten(-2)
    return rule


def kivi_rule(tokens: int = 32, symmetric: bool = False, bits: int = 4):
    """Per-channel integers of `bits` over groups of `tokens` positions (asymmetric: fp16 scale and zero per
    channel and group, 32/tokens bits per element; symmetric: fp16 scale, 16/tokens); the incomplete tail stays
    unquantized, as KIVI's residual window of recent tokens does."""
    qmax = 2 ** bits - 1

    def rule(x: torch.Tensor) -> torch.Tensor:
        full = x.shape[0] // tokens * tokens
        if not full:
            return x
        xg = x[:full].unflatten(0, (full // tokens, tokens))  # [G, tokens, H, D]
        if symmetric:
            s = round_up_to((xg.abs().amax(1, keepdim=True) / (qmax // 2)).clamp_min(1e-8), torch.float16).float()
            y = torch.round(xg / s).clamp(-(qmax // 2), qmax // 2) * s
        else:
            y = _asym_round_trip(xg, 1, qmax)
        return torch.cat((y.flatten(0, 1), x[full:]))
    return rule


def _asym_round_trip(x: torch.Tensor, dim: int, qmax: int) -> torch.Tensor:
    """Asymmetric integers 0..qmax over `dim`: zero = the fp16 min rounded down, scale = the range / qmax rounded
    up to fp16; the values they give back."""
    lo = round_down_to(x.amin(dim, keepdim=True), torch.float16).float()
    s = round_up_to(((x.amax(dim, keepdim=True) - lo) / qmax).clamp_min(1e-8), torch.float16).float()
    return torch.round((x - lo) / s).clamp(0, qmax) * s + lo


def asym_rule(bits: int, group: int):
    """Per-token asymmetric integers of `bits` over groups of `group` channels, fp16 scale and zero (rounded
    outward): bits + 32/group bits per element. The formats below 4 bits kvq does not store."""
    def rule(x: torch.Tensor) -> torch.Tensor:
        return _asym_round_trip(_groups(x, group), -1, 2 ** bits - 1).flatten(-2)
    return rule


def rule_for(spec: str):
    """'clip-g32', 'nf4-g32', 'kivi[-t<tokens>][-b<bits>][-sym]', 'asym-b<bits>-g<group>', 'mse:<format name>',
    or a KV format name (one side)."""
    if spec.startswith("mse:"):
        return mse_scale_rule(format_from_name(spec[4:]))
    if spec.startswith("clip-g"):
        return clip_rule(int(spec[6:]))
    if spec.startswith("nf4-g"):
        return nf4_rule(int(spec[5:]))
    if spec.startswith("kivi"):
        parts = spec.split("-")[1:]
        tokens = next((int(p[1:]) for p in parts if p.startswith("t")), 32)
        bits = next((int(p[1:]) for p in parts if p.startswith("b")), 4)
        return kivi_rule(tokens, "sym" in parts, bits)
    if spec.startswith("asym-b"):
        bits, group = spec[6:].split("-g")
        return asym_rule(int(bits), int(group))
    return format_rule(format_from_name(spec))


class ScreenRoundTrip:
    """K and V rules for every layer, or (`layers`, `rest`) for those layers only, `rest`'s elsewhere."""

    def __init__(self, k_spec: str, v_spec: str, sink: int = 0, layers: range | None = None,
                 rest: "ScreenRoundTrip | None" = None):
        self.k, self.v, self.sink = rule_for(k_spec), rule_for(v_spec), sink
        self.keep = format_rule(KVFormat("int8", "per_token"))
        self.layers, self.rest = layers, rest

    def _side(self, rule, x: torch.Tensor) -> torch.Tensor:
        y = rule(x)
        if self.sink:
            y = torch.cat((self.keep(x[: self.sink]), y[self.sink:]))
        return y

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.layers is not None and layer not in self.layers:
            return self.rest(layer, k, v)
        return self._side(self.k, k), self._side(self.v, v)


# name -> (K rule, V rule, sink tokens at INT8, rotated, bits per element incl. metadata at head_dim 64)
CANDIDATES = {
    "int4-asym+rot": ("int4-per_token-asym", "int4-per_token-asym", 0, True, 4.5),
    "int4-g32+rot": ("int4-per_token-g32", "int4-per_token-g32", 0, True, 4.5),
    "k.int4-g32+v.int4-asym+rot": ("int4-per_token-g32", "int4-per_token-asym", 0, True, 4.5),
    "clip-g32+rot": ("clip-g32", "clip-g32", 0, True, 4.5),
    "k.clip-g32+v.int4-asym+rot": ("clip-g32", "int4-per_token-asym", 0, True, 4.5),
    "nf4-g32+rot": ("nf4-g32", "nf4-g32", 0, True, 4.5),
    "nf4-g64+rot": ("nf4-g64", "nf4-g64", 0, True, 4.25),
    "k.nf4-g32+v.int4-asym+rot": ("nf4-g32", "int4-per_token-asym", 0, True, 4.5),
    "k.kivi+v.int4-asym": ("kivi", "int4-per_token-asym", 0, False, 4.75),
    "k.kivi+v.int4-asym+rot": ("kivi", "int4-per_token-asym", 0, True, 4.75),
    "k.kivi-t64+v.int4-asym+rot": ("kivi-t64", "int4-per_token-asym", 0, True, 4.5),
    "k.kivi-t64+v.int4-asym": ("kivi-t64", "int4-per_token-asym", 0, False, 4.5),
    "k.kivi-sym+v.int4-asym+rot": ("kivi-sym", "int4-per_token-asym", 0, True, 4.5),
    "k.kivi-t64+v.nf4-g64+rot": ("kivi-t64", "nf4-g64", 0, True, 4.375),
    # below 4 bits a side (kvq stores none of these): KIVI's 2-bit keys and values, and 3-bit ones
    "k.kivi-t64+v.asym-b3-g32+rot": ("kivi-t64", "asym-b3-g32", 0, True, 4.25),
    "k.kivi-t64+v.asym-b2-g32+rot": ("kivi-t64", "asym-b2-g32", 0, True, 3.75),
    "k.kivi-t64-b3+v.int4-asym+rot": ("kivi-t64-b3", "int4-per_token-asym", 0, True, 4.0),
    "k.kivi-t64-b2+v.int4-asym+rot": ("kivi-t64-b2", "int4-per_token-asym", 0, True, 3.5),
    "k.kivi-t64-b2+v.asym-b2-g32+rot": ("kivi-t64-b2", "asym-b2-g32", 0, True, 2.75),
    "int4-asym-g32+rot": ("int4-per_token-asym-g32", "int4-per_token-asym-g32", 0, True, 5.0),
    "sink4:k.int4-g32+v.int4-asym+rot": ("int4-per_token-g32", "int4-per_token-asym", 4, True, 4.5),
    "sink4:nf4-g32+rot": ("nf4-g32", "nf4-g32", 4, True, 4.5),
    "k8v4-g32+rot": ("int8-per_token", "int4-per_token-asym-g32", 0, True, 6.62),
    "k8v4+rot": ("int8-per_token", "int4-per_token-asym", 0, True, 6.38),
    "k8v4-nf4-g32+rot": ("int8-per_token", "nf4-g32", 0, True, 6.38),
    "k8v4-g32": ("int8-per_token", "int4-per_token-asym-g32", 0, False, 6.62),
    "sink4:k8v4-g32+rot": ("int8-per_token", "int4-per_token-asym-g32", 4, True, 6.62),
}
# FP8 variants: scale granularity (per token-head or per 32 channels), scale dtype, rotation, scale choice, e5m2
for _rot in (False, True):
    for _fmt, _bits in (("fp8_e4m3-per_token", 8.25), ("fp8_e4m3-per_token-sfp32", 8.5),
                        ("fp8_e4m3-per_token-sbf16", 8.25), ("fp8_e4m3-per_token-g32", 8.5),
                        ("fp8_e4m3-per_token-g32-sfp32", 9.0), ("mse:fp8_e4m3-per_token", 8.25),
                        ("mse:fp8_e4m3-per_token-g32", 8.5), ("fp8_e5m2-per_token", 8.25),
                        ("fp8_e5m2-per_token-g32", 8.5), ("int8-per_token", 8.25)):
        CANDIDATES[_fmt + ("+rot" if _rot else "")] = (_fmt, _fmt, 0, _rot, _bits)


def _earlier_baseline(path: str, ppl_tokens: int, texts: dict) -> dict:
    """The baseline perplexities of an earlier run on the same windows (same model, --ppl-tokens and texts)."""
    earlier = json.loads(Path(path).read_text())
    if earlier.get("ppl_tokens") != ppl_tokens or not texts.keys() <= earlier["baseline"].keys():
        raise SystemExit(f"--baseline-from {path}: scored {earlier.get('ppl_tokens')} tokens of "
                         f"{sorted(earlier['baseline'])}; this run needs {ppl_tokens} of {sorted(texts)}.")
    return {t: earlier["baseline"][t] for t in texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--only", default=None, help="candidates, comma-separated; NAME@A-B: in layers A-B only")
    ap.add_argument("--rest", default="k.kivi-t64+v.int4-asym+rot", help="the other layers' candidate for NAME@A-B")
    ap.add_argument("--ood", action="store_true", help="also the out-of-domain text")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--baseline-from", default=None,
                    help="an earlier output of the same model and --ppl-tokens: reuse its unquantized perplexities")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = args.only.split(",") if args.only else list(CANDIDATES)
    tok = load_tokenizer(args.model_dir)
    texts = {"held_out": eval_windows(tok, args.ppl_tokens, 1024)}
    if args.ood:
        texts["ood"] = eval_windows(tok, args.ppl_tokens, 1024, OUT_OF_DOMAIN)
    models = {NO_ROTATION: load_model(args.model_dir, device=args.device)}
    base = _earlier_baseline(args.baseline_from, args.ppl_tokens, texts) if args.baseline_from else {
        t: perplexity(DenseScorer(models[NO_ROTATION]), w)["perplexity"] for t, w in texts.items()}
    res = {"baseline": base, "ppl_tokens": args.ppl_tokens, "candidates": {}}
    for name in names:
        cand, _, span = name.partition("@")
        k, v, sink, rot, bits = CANDIDATES[cand]
        layers = rest = None
        if span:  # the candidate in these layers only, --rest in the others (the same rotation)
            a, _, b = span.partition("-")
            layers = range(int(a), int(b or a) + 1)
            rk, rv, rsink, rrot, _ = CANDIDATES[args.rest]
            if rrot != rot:
                raise SystemExit(f"{name}: --rest {args.rest} must have the candidate's rotation")
            rest = ScreenRoundTrip(rk, rv, rsink)
        r = HADAMARD if rot else NO_ROTATION
        if r not in models:
            models[r] = load_model(args.model_dir, device=args.device, rotation=r)
        t0 = time.perf_counter()
        row = {"k": k, "v": v, "sink": sink, "rotation": r.name, "bits_per_element": bits}
        if span:
            row.update(layers=span, rest=args.rest)
        for t, w in texts.items():
            ppl = perplexity(DenseScorer(models[r], ScreenRoundTrip(k, v, sink, layers, rest)), w)["perplexity"]
            row[f"change_pct_{t}"] = (ppl / base[t] - 1) * 100
        row["seconds"] = round(time.perf_counter() - t0, 1)
        res["candidates"][name] = row
        print(name, {x: round(y, 2) for x, y in row.items() if x.startswith("change")}, flush=True)
        write_json_atomic(Path(args.out), res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
