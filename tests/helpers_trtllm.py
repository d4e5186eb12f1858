"""TensorRT-LLM's own loading rules, from tests/data/trtllm_upstream.json, for contract tests.

TensorRT-LLM cannot be installed here. These helpers do what its code does
with a checkpoint and a command line, written from the extracted facts (not
from kvq's writer): build config objects the way PretrainedConfig/QuantConfig/
Mapping accept keyword arguments, load rank{N}.safetensors per rank with
`PretrainedModel.load`'s required/provided rule, split HF weights the way its
HF converter does, and parse argv with trtllm-build's argparse.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors import safe_open

UPSTREAM_FILE = Path(__file__).parent / "data" / "trtllm_upstream.json"
UPSTREAM = json.loads(UPSTREAM_FILE.read_text())
_TYPES = {"int": int, "str": str}


def trtllm_build_parser() -> argparse.ArgumentParser:
    """trtllm-build's argparse (commands/build.py + plugin.py add_plugin_argument)."""
    f = UPSTREAM["trtllm_build"]
    p = argparse.ArgumentParser(prog="trtllm-build", exit_on_error=False)
    for name, typ in f["value_flags"].items():
        p.add_argument(f"--{name}", type=_TYPES[typ])
    for name, choices in f["choice_flags"].items():
        p.add_argument(f"--{name}", choices=choices)
    for name in f["store_true_flags"]:
        p.add_argument(f"--{name}", action="store_true")
    for name in f["plugin_dtype_flags"]:
        p.add_argument(f"--{name}", choices=f["plugin_dtype_options"])
    for name in f["plugin_switches"]:
        p.add_argument(f"--{name}", choices=["enable", "disable"])
    for name in f["plugin_int_flags"]:
        p.add_argument(f"--{name}", type=int)
    return p


def parse_trtllm_build(argv: list[str]) -> argparse.Namespace:
    """Parse like trtllm-build; an unknown flag or value raises (argparse.ArgumentError / SystemExit)."""
    assert argv[0] == "trtllm-build", argv
    ns, unknown = trtllm_build_parser().parse_known_args(argv[1:])
    assert not unknown, f"trtllm-build has no flag(s) {unknown}"
    return ns


def pretrained_config(config: dict) -> dict:
    """Check config.json the way LLaMAConfig(**config) / QuantConfig(**q) / Mapping(**m) accept it."""
    pc = UPSTREAM["pretrained_config"]
    missing = [k for k in pc["required"] if k not in config]
    assert not missing, f"PretrainedConfig.__init__ needs {missing}"
    known = {*pc["required"], *pc["optional"], *pc["llama_config_keys"], *pc["implicit_keys_from_hf_converter"]}
    implicit = sorted(set(config) - known)
    assert not implicit, f"keys TensorRT-LLM would only set implicitly (with a warning): {implicit}"
    assert config["dtype"] in pc["dtypes"], config["dtype"]
    assert config["position_embedding_type"] == pc["llama_position_embedding_type"]
    q = config.get("quantization") or {}
    qc = UPSTREAM["quant_config"]
    assert set(q) <= set(qc["fields"]), f"QuantConfig has no field(s) {set(q) - set(qc['fields'])}"
    assert q.get("kv_cache_quant_algo") in (None, *qc["kv_cache_quant_algos"])
    m = dict(config.get("mapping") or {})
    assert set(m) <= set(UPSTREAM["mapping"]["kwargs"]), f"Mapping() takes no {set(m) - set(UPSTREAM['mapping']['kwargs'])}"
    tp, pp, cp = m.get("tp_size", 1), m.get("pp_size", 1), m.get("cp_size", 1)
    assert m.get("world_size", 1) == tp * pp * cp, "world_size must equal tp_size * pp_size * cp_size"
    moe_tp, moe_ep = m.get("moe_tp_size", -1), m.get("moe_ep_size", -1)
    if moe_tp != -1 or moe_ep != -1:
        moe_tp = tp // max(moe_ep, 1) if moe_tp == -1 else moe_tp
        moe_ep = tp // moe_tp if moe_ep == -1 else moe_ep
        assert moe_tp * moe_ep == tp, "tp_size must equal moe_tp_size * moe_ep_size * moe_cluster_size"
    heads = config["num_attention_heads"]
    return {
        "tp": tp, "pp": pp, "layers": config["num_hidden_layers"], "H": config["hidden_size"],
        "heads": heads, "kv_heads": config.get("num_key_value_heads") or heads,
        "d": config.get("head_size") or config["hidden_size"] // heads,
        "I": config.get("intermediate_size") or 4 * config["hidden_size"], "V": config.get("vocab_size"),
        "dtype": config["dtype"], "kv_algo": q.get("kv_cache_quant_algo"),
    }


def pp_layers(num_layers: int, pp: int, pp_rank: int) -> list[int]:
    assert pp <= num_layers, "pp size cannot be larger than num_hidden_layers"
    return torch.tensor_split(torch.arange(num_layers), pp)[pp_rank].tolist()


def required_parameters(c: dict, rank: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter LLaMAForCausalLM declares on `rank`."""
    lp = UPSTREAM["llama_parameters"]
    tp, pp_rank = c["tp"], rank // c["tp"]
    sym = {"H": c["H"], "nh": c["heads"] // tp, "nkv": math.ceil(c["kv_heads"] / tp), "d": c["d"],
           "I": c["I"] // tp, "V": c["V"], "Vp": math.ceil(c["V"] / tp)}

    def shape(exprs):
        return tuple(int(eval(e, {"__builtins__": {}}, sym)) for e in exprs)  # noqa: S307 -- our own data file

    out = {}
    if pp_rank == 0:
        out.update({k: shape(v) for k, v in lp["first_pp_rank"].items()})
    per_layer = dict(lp["per_layer"], **(lp["per_layer_kv_quant"] if c["kv_algo"] else {}))
    for local, _ in enumerate(pp_layers(c["layers"], c["pp"], pp_rank)):
        out.update({f"transformer.layers.{local}.{k}": shape(v) for k, v in per_layer.items()})
    if pp_rank == c["pp"] - 1:
        out.update({k: shape(v) for k, v in lp["last_pp_rank"].items()})
    return out


def from_checkpoint(ckpt_dir: Path) -> tuple[dict, dict[int, dict[str, torch.Tensor]]]:
    """Every rank as PretrainedModel.from_checkpoint(ckpt_dir, rank) + load() would take it."""
    c = pretrained_config(json.loads((Path(ckpt_dir) / "config.json").read_text()))
    ranks = {}
    for rank in range(c["tp"] * c["pp"]):
        path = Path(ckpt_dir) / UPSTREAM["from_checkpoint"]["weights_file"].format(rank=rank)
        assert path.is_file(), f"from_checkpoint asserts {path} exists"
        with safe_open(str(path), framework="pt") as f:
            weights = {k: f.get_tensor(k) for k in f.keys()}
        required = required_parameters(c, rank)
        not_provided = set(required) - set(weights)
        assert not not_provided, f"rank {rank}: Required but not provided tensors: {sorted(not_provided)}"
        extra = set(weights) - set(required)
        assert not extra, f"rank {rank}: Provided but not required tensors: {sorted(extra)}"
        dtype = getattr(torch, c["dtype"])
        for name, want in required.items():
            assert tuple(weights[name].shape) == want, f"rank {rank} {name}: {tuple(weights[name].shape)} != {want}"
            scale = name.endswith("scaling_factor")
            assert weights[name].dtype == (torch.float32 if scale else dtype), f"rank {rank} {name}: {weights[name].dtype}"
        ranks[rank] = weights
    return c, ranks


def hf_converter_rank(sd: dict[str, torch.Tensor], c: dict, tied: bool, rank: int) -> dict[str, torch.Tensor]:
    """The tensors TensorRT-LLM's HF converter puts on `rank` (names and split rules from the facts)."""
    names, split = UPSTREAM["hf_converter"]["names"], UPSTREAM["hf_converter"]["split"]
    tp, tp_rank, pp_rank = c["tp"], rank % c["tp"], rank // c["tp"]
    d = c["d"]

    def part(w, dim):
        return torch.chunk(w, tp, dim=dim)[tp_rank]

    def kv_part(w):
        if c["kv_heads"] < tp:  # dup_kv_weight: each head repeated tp / kv_heads times
            w = w.reshape(c["kv_heads"], d, -1).repeat_interleave(tp // c["kv_heads"], dim=0).reshape(tp * d, -1)
        return part(w, 0)

    out = {}
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = sd[names["transformer.vocab_embedding.weight"]]
    for local, layer in enumerate(pp_layers(c["layers"], c["pp"], pp_rank)):
        hf, trt = f"model.layers.{layer}.", f"transformer.layers.{local}."
        for name, src in names.items():
            if name.startswith(("transformer.", "lm_head")):
                continue
            if name == "attention.qkv.weight":
                q, k, v = (sd[hf + s] for s in src)
                out[trt + name] = torch.cat([part(q, 0), kv_part(k), kv_part(v)])
            elif name in split["column"]:
                out[trt + name] = part(sd[hf + src], 0)
            elif name in split["row"]:
                out[trt + name] = part(sd[hf + src], 1)
            else:
                out[trt + name] = sd[hf + src]
    if pp_rank == c["pp"] - 1:
        out["transformer.ln_f.weight"] = sd[names["transformer.ln_f.weight"]]
        head = sd["model.embed_tokens.weight" if tied else "lm_head.weight"]
        pad = math.ceil(c["V"] / tp) * tp - c["V"]
        out["lm_head.weight"] = part(torch.cat([head, head.new_zeros(pad, head.shape[1])]), 0)
    return out


# A stand-in for trtllm-build that accepts exactly upstream's argparse, loads every rank as
# build_model does, and writes the engine directory Engine.save writes (config.json +
# rank{N}.engine); the engine bytes are a marker.
FAKE_TRTLLM_BUILD = f"""#!{sys.executable}
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from helpers_trtllm import from_checkpoint, parse_trtllm_build
args = parse_trtllm_build(["trtllm-build", *sys.argv[1:]])
ckpt = Path(args.checkpoint_dir)
config = json.loads((ckpt / "config.json").read_text())
c, _ = from_checkpoint(ckpt)  # build_model loads every rank with from_checkpoint
out = Path(args.output_dir)
out.mkdir(parents=True, exist_ok=True)
build_config = {{k: v for k, v in vars(args).items() if v is not None and k not in ("checkpoint_dir", "output_dir")}}
(out / "config.json").write_text(json.dumps({{"version": "fake", "pretrained_config": config,
                                              "build_config": build_config}}))
for rank in range(c["tp"] * c["pp"]):
    (out / f"rank{{rank}}.engine").write_bytes(b"fake engine rank %d" % rank)
print("[TensorRT-LLM][INFO] Number of tokens per block: %s." % args.tokens_per_block)
"""


def install_fake_trtllm_build(bindir: Path) -> Path:
    bindir.mkdir(parents=True, exist_ok=True)
    exe = bindir / "trtllm-build"
    exe.write_text(FAKE_TRTLLM_BUILD)
    exe.chmod(0o755)
    return exe
