"""KV rotation: an orthogonal transform over head_dim applied before K and V are stored.

At 4 bits (and for FP8 scales calibrated on other text) a few outlier channels
of K decide the quantization step of every other channel. A normalized
Walsh-Hadamard transform M (optionally with a fixed random sign vector, M =
diag(s) H / sqrt(d)) spreads every channel over all of them, so the stored
values have no outlier channels, and since M is orthogonal the model computes
the same function in exact arithmetic (QuaRot / SpinQuant):

* K and q, after RoPE: q' = q M, k' = k M, so q'.k' = q M M^T k^T = q.k. The
  model multiplies the step's q and k (one tensor) by M right after RoPE, so
  the cache, the kernels and calibration only ever see rotated keys.
* V: v' = v M is folded into v_proj's rows (W_v' = M^T W_v per KV head), and
  the inverse into o_proj's columns (W_o' = W_o M per query head): attention is
  linear in V, so every query head's output comes out rotated by M and o_proj
  rotates it back. One M for every head makes GQA exact: the query heads that
  share a KV head all undo the same rotation. No cost per decode step.

The rotation is not part of the KV format (it changes what is stored, not how
it is stored): kv_format.json records it beside the format, under "rotation".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnsupportedError

ROTATIONS = ("none", "hadamard")


@dataclass(frozen=True)
class KVRotation:
    kind: str = "none"
    seed: int | None = 0  # sign vector from this seed; None: the plain Walsh-Hadamard matrix

    def __post_init__(self) -> None:
        if self.kind not in ROTATIONS:
            raise UnsupportedError(f"kv.rotation: unknown rotation {self.kind!r}; choose one of {', '.join(ROTATIONS)}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise UnsupportedError(f"kv.rotation_seed must be a non-negative integer or null, got {self.seed!r}.")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def name(self) -> str:
        if not self.active:
            return "none"
        return self.kind if self.seed is None else f"{self.kind}-s{self.seed}"

    def check(self, head_dim: int) -> None:
        if self.active and (head_dim < 1 or head_dim & (head_dim - 1)):
            raise UnsupportedError(
                f"kv.rotation: hadamard needs a power-of-two head_dim (Sylvester construction), this model has "
                f"{head_dim}; use kv.rotation: none."
            )

    def signs(self, head_dim: int) -> torch.Tensor:
        """[head_dim] fp64 +-1 (all ones without a seed); torch's CPU generator is the same everywhere."""
        if self.seed is None:
            return torch.ones(head_dim, dtype=torch.float64)
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, 2, (head_dim,), generator=g).to(torch.float64) * 2 - 1

    def matrix(self, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """M [head_dim, head_dim], orthogonal: rows of x are rotated as x @ M."""
        self.check(head_dim)
        if not self.active:
            return torch.eye(head_dim, dtype=dtype)
        return (self.signs(head_dim)[:, None] * walsh_hadamard(head_dim)).to(dtype)

    def to_json(self, head_dim: int) -> dict:
        """What kv_format.json records: the kind, the seed and the sign vector itself."""
        out: dict = {"kind": self.kind, "seed": self.seed}
        if self.active:
            out["signs"] = [int(s) for s in self.signs(head_dim)]
        return out

    @classmethod
    def from_json(cls, d: dict | None, head_dim: int, where: str = "kv_format.json") -> "KVRotation":
        if not d:
            return cls()
        if not isinstance(d, dict):
            raise UnsupportedError(f"{where}: 'rotation' must be an object {{kind, seed, signs}}; rebuild the engine.")
        rot = cls(d.get("kind", "none"), d.get("seed"))
        rot.check(head_dim)
        # The recorded signs are the contract: a torch whose generator drew other signs would otherwise
        # load the folded weights with a different rotation than the one calibration saw.
        if rot.active and "signs" in d and [int(s) for s in d["signs"]] != rot.to_json(head_dim)["signs"]:
            raise UnsupportedError(f"{where}: the recorded rotation signs differ from seed {rot.seed}'s; "
                                   "rebuild the engine with this torch.")
        return rot


NO_ROTATION = KVRotation()


def walsh_hadamard(n: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix [n, n] in fp64 (symmetric, H H^T = I); n a power of two."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n**0.5


# ----------------------------------------------------------- weight folding
def fold_v_proj(w_v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """v_proj weight [kv_heads * D, hidden] -> the one producing v' = v M for every KV head."""
    d = m.shape[0]
    w = w_v.to(torch.float64).view(-1, d, w_v.shape[-1])
    return torch.matmul(m.to(torch.float64).T, w).reshape(w_v.shape).to(w_v.dtype)


def fold_o_proj(w_o: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """o_proj weight [hidden, heads * D] -> the one taking every head's output rotated by M (W_o' = W_o M)."""
    d = m.shape[0]
    w = w_o.to(torch.float64).view(w_o.shape[0], -1, d)
    return torch.matmul(w, m.to(torch.float64)).reshape(w_o.shape).to(w_o.dtype)
