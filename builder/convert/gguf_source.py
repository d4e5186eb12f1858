"""Read a llama.cpp GGUF file as HF-named fp32 tensors.

Quantized blocks (Q4_1, Q8_0, ...) are dequantized per tensor with the gguf
package. llama.cpp stores q_proj/k_proj rows permuted for its interleaved RoPE
(convert_hf_to_gguf.py's `permute`); HF's rotate-half RoPE needs the original
order, so load() undoes it (environment.md gives the inverse).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.config import ModelConfig
from runtime.errors import InputError, UnsupportedError

from .hf import check_tensor_table
from .llama_names import hf_name_to_gguf, hf_tensor_shapes

_REQUIRED = object()


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation for a [rows, cols] weight."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class GGUFSource:
    """Tensors of a GGUF Llama file, by HF name, dequantized on demand."""

    def __init__(self, path: str | Path):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{self.path} does not exist; pass the path of a .gguf file.")
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 -- gguf raises ValueError/struct.error/IndexError/... for damaged files
            raise InputError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                             "it is truncated or corrupt.") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.cfg = self._config()
        self.shapes = {}
        for hf_name in hf_tensor_shapes(self.cfg.replace(tie_word_embeddings=False)):
            t = self._tensors.get(hf_name_to_gguf(hf_name))
            if t is not None:
                # GGUF lists dimensions fastest-first; torch wants them slowest-first.
                self.shapes[hf_name] = tuple(int(x) for x in reversed(t.shape.tolist()))
        check_tensor_table(self.cfg, self.shapes, self.origin)

    def _field(self, key: str, default=_REQUIRED):
        f = self._reader.fields.get(key)
        if f is None:
            if default is _REQUIRED:
                raise InputError(f"{self.path}: metadata {key} is missing; the GGUF file is incomplete.")
            return default
        return f.contents()

    def _config(self) -> ModelConfig:
        arch = self._field("general.architecture")
        if arch != "llama":
            raise UnsupportedError(f"{self.path}: GGUF architecture {arch!r} is not supported; "
                                   "kvq converts Llama-family GGUF files (general.architecture = 'llama').")
        scaling = self._field("llama.rope.scaling.type", "none")
        if scaling != "none" or "rope_freqs.weight" in self._tensors:
            raise UnsupportedError(f"{self.path}: GGUF rope scaling is not supported; convert the "
                                   "original Hugging Face checkpoint instead.")
        heads = int(self._field("llama.attention.head_count"))
        hidden = int(self._field("llama.embedding_length"))
        embd = self._tensors.get("token_embd.weight")
        if embd is None:
            raise InputError(f"{self.path}: tensor token_embd.weight is missing; the GGUF file is incomplete.")
        vocab = int(self._field("llama.vocab_size", int(embd.shape[-1])))
        # Metadata floats are float32: print them at float32 precision (1e-05, not 9.99999974e-06).
        eps = float(str(np.float32(self._field("llama.attention.layer_norm_rms_epsilon"))))
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._field("llama.feed_forward_length")),
            num_layers=int(self._field("llama.block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field("llama.attention.head_count_kv", heads)),
            head_dim=int(self._field("llama.rope.dimension_count", hidden // heads)),
            rms_norm_eps=eps,
            rope_theta=float(str(np.float32(self._field("llama.rope.freq_base", 10000.0)))),
            max_position_embeddings=int(self._field("llama.context_length", 8192)),
            tie_word_embeddings="output.weight" not in self._tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id", None),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id", None),
        )

    def origin(self, name: str) -> str:
        try:
            return f"{self.path} [{hf_name_to_gguf(name)}]"
        except KeyError:
            return str(self.path)

    def load(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self._tensors[hf_name_to_gguf(name)]
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:  # noqa: BLE001 -- any failure here means damaged block data
            raise InputError(f"{self.origin(name)}: tensor cannot be dequantized ({type(e).__name__}: {e}).") from None
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # unquantized tensors come back as views of the read-only mmap
            arr = arr.copy()
        w = torch.from_numpy(arr).reshape(self.shapes[name])
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rope(w, self.cfg.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rope(w, self.cfg.num_kv_heads)
        return w
