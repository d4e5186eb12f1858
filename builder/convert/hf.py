"""Read a Hugging Face Llama directory (config.json + safetensors, sharded or not).

`HFCheckpoint` only reads headers when opened and loads one tensor per call,
so converters and the TensorRT-LLM writer never hold more than the tensor they
are working on. Every file problem becomes an InputError that names the file
(and the tensor when there is one); pickled `.bin` checkpoints are refused
rather than unpickled (design.md: nothing is unpickled).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from runtime.config import ModelConfig
from runtime.errors import InputError, UnsupportedError

from .llama_names import IGNORABLE, hf_tensor_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class HFCheckpoint:
    """Tensors of a HF Llama directory, by HF name, loaded on demand."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        if not self.dir.is_dir():
            raise InputError(f"{self.dir} is not a directory; pass a Hugging Face model directory "
                             "(config.json + *.safetensors).")
        self.cfg = ModelConfig.from_dir(self.dir)
        self._file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.files = self._weight_files()
        for f in self.files:
            self._read_header(f)

    # ----------------------------------------------------------- discovery
    def _weight_files(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise InputError(f"{index} is not a valid safetensors index ({e!r}); "
                                 "re-download or regenerate it.") from None
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise InputError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}; "
                                 "download the complete checkpoint.")
            return [self.dir / f for f in files]
        if (self.dir / SINGLE_FILE).is_file():
            return [self.dir / SINGLE_FILE]
        found = sorted(self.dir.glob("*.safetensors"))
        if found:
            return found
        if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt")):
            raise UnsupportedError(
                f"{self.dir} holds only pickled PyTorch weights (*.bin/*.pt), which kvq does not "
                "unpickle; convert them to safetensors first (e.g. transformers' save_pretrained)."
            )
        raise InputError(f"{self.dir} has no *.safetensors weights; point to a complete HF model directory.")

    def _read_header(self, f: Path) -> None:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    if name in self._file_of:
                        raise InputError(f"tensor {name} appears in both {self._file_of[name]} and {f}; "
                                         "the checkpoint shards overlap.")
                    self._file_of[name] = f
                    self.shapes[name] = tuple(sl.get_shape())
                    self.dtypes[name] = _torch_dtype(sl.get_dtype(), f, name)
        except SafetensorError as e:
            raise InputError(f"{f} is not a readable safetensors file ({e}); it is truncated or "
                             "corrupt: re-download or re-export it.") from None
        except OSError as e:
            raise InputError(f"{f} cannot be read ({e}).") from None

    # ------------------------------------------------------------- access
    def origin(self, name: str) -> str:
        """The file holding `name`; for a tensor that is absent, the file(s) searched."""
        if name in self._file_of:
            return str(self._file_of[name])
        index = self.dir / INDEX_FILE
        return str(index) if index.is_file() else ", ".join(str(f) for f in self.files)

    def load(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """One tensor (optionally a range of its first dimension), as its stored dtype.

        A whole tensor is backed by the file's read-only mapping (no copy): its
        pages become resident as they are read and are released with the tensor.
        Never modify it in place.
        """
        f = self._file_of[name]
        try:
            with safe_open(f, framework="pt") as st:
                return st.get_tensor(name) if rows is None else st.get_slice(name)[rows]
        except SafetensorError as e:
            raise InputError(f"{f}: tensor {name} cannot be read ({e}); the file is corrupt.") from None

    def check_llama(self) -> dict[str, tuple[int, ...]]:
        """Verify names, shapes and dtypes against the Llama table; returns the expected shapes."""
        return check_tensor_table(self.cfg, self.shapes, self.origin, self.dtypes)


def _torch_dtype(code: str, f: Path, name: str) -> torch.dtype:
    table = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8,
             "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
    if code not in table:
        raise UnsupportedError(f"{f}: tensor {name} has dtype {code}, which kvq cannot convert.")
    return table[code]


def check_tensor_table(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], origin,
                       dtypes: dict[str, torch.dtype] | None = None) -> dict[str, tuple[int, ...]]:
    """Compare available tensors with what `cfg` needs; raise naming the first bad file/tensor."""
    expected = hf_tensor_shapes(cfg)
    for name, shape in expected.items():
        if name not in shapes:
            raise InputError(f"{origin(name)}: tensor {name} is missing; the checkpoint is incomplete "
                             "or does not match config.json.")
        if tuple(shapes[name]) != shape:
            raise InputError(f"{origin(name)}: tensor {name} has shape {list(shapes[name])}, config.json "
                             f"implies {list(shape)}; the weights do not match the config.")
        if dtypes is not None and dtypes[name] not in _FLOAT_DTYPES:
            raise UnsupportedError(f"{origin(name)}: tensor {name} is stored as {dtypes[name]}; kvq converts "
                                   "unquantized fp32/fp16/bf16 checkpoints only.")
    for name in shapes:
        if name in expected or IGNORABLE.search(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some exports store the tied head anyway; the embedding is authoritative
        raise UnsupportedError(f"{origin(name)}: unexpected tensor {name}; kvq supports the plain Llama "
                               "architecture (no biases, no extra modules).")
    return expected
