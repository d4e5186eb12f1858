"""CUDA graphs of decode-only steps, one per batch-size bucket.

An eager decode step of an 8B model launches ~15 kernels per layer from Python;
on the H200 the host needs 30-46 ms to enqueue one step of 32 layers, as long as
the GPU needs to run it (benchmarks/results/headline.md), so a faster attention
kernel did not show end to end. A captured step is one `replay()`.

Each bucket (1, 2, 4, then multiples of 8 up to the engine's batch limit) has
static input tensors and a graph captured on first use. A step of n sequences
copies its inputs into the first n rows of the bucket's tensors; the padding rows
write nowhere (slot -1, which the write kernel skips), attend to one token of
block 0 and their logits are dropped. Block tables are padded to the engine's
longest sequence, so the attention kernel's split count is fixed at capture
(empty splits cost one early-exiting program each). Rows do not interact, so a
sequence's logits do not depend on what fills the other rows of its bucket.

Memory: each captured bucket keeps its own pool, about one decode step of that many
tokens (activations, and [bucket, vocab] logits in the model dtype and fp32: 0.1 GB for
192 rows of a 128k vocabulary); it comes out of the GPU memory the pool sizing leaves
free (`gpu_memory_fraction`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import reference_backend
from .kv_cache import LayerCache
from .model import LlamaModel, PagedBatch


def can_capture(backend) -> bool:
    """Whether a decode step through `backend` can be captured and padded: the Triton write
    skips slot -1 (the reference write would wrap it to the pool's last block) and the Triton
    decode attention never syncs with the host (the reference one sizes its gather there)."""
    ref = reference_backend()
    return backend.write_kv is not ref.write_kv and backend.decode_attention is not ref.decode_attention


def bucket_for(n: int) -> int:
    """The captured batch size that serves n sequences: 1, 2, 4, then multiples of 8."""
    if n <= 4:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: PagedBatch  # the static inputs the graph reads
    logits: torch.Tensor  # the static output it writes


class DecodeGraphs:
    def __init__(self, model: LlamaModel, caches: list[LayerCache], backend, max_batch: int, max_seq_len: int,
                 block_size: int):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.caches, self.backend = model, caches, backend
        self.max_batch = max_batch
        self.max_blocks = -(-max_seq_len // block_size)
        self.max_position = max_seq_len - 1
        self._graphs: dict[int, _Captured] = {}
        self.failure: str | None = None  # why capture failed; from then on every step runs eagerly
        # The RoPE table at its final size now: a captured graph reads the table it saw, so the
        # table must never be rebuilt (grown) after a capture.
        model.rotary.table(model.device, max_seq_len)

    def run(self, batch: PagedBatch) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode-only batch by graph replay; None if it is not one this
        runner can serve (prefill tokens, more sequences or longer tables than captured)."""
        n = batch.num_decode
        if self.failure is not None or n == 0 or batch.input_ids.shape[0] != n or n > self.max_batch:
            return None
        if batch.block_tables.shape[1] > self.max_blocks:
            return None
        size = bucket_for(n)
        captured = self._graphs.get(size)
        if captured is None:
            try:
                captured = self._capture(size)
            except RuntimeError as e:  # an op that cannot be captured: serve eagerly, say why
                self.failure = f"{type(e).__name__}: {e}"
                return None
        static = captured.batch
        width = batch.block_tables.shape[1]
        static.input_ids.zero_()
        static.positions.zero_()
        static.slot_mapping.fill_(-1)
        static.block_tables.zero_()
        static.seq_lens.fill_(1)
        static.input_ids[:n].copy_(batch.input_ids)
        static.positions[:n].copy_(batch.positions)
        static.slot_mapping[:n].copy_(batch.slot_mapping)
        static.block_tables[:n, :width].copy_(batch.block_tables)
        static.seq_lens[:n].copy_(batch.seq_lens)
        captured.graph.replay()
        return captured.logits[:n].clone()

    def _capture(self, size: int) -> _Captured:
        dev = self.model.device

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        static = PagedBatch(
            input_ids=zeros(size, dtype=torch.int64),
            positions=zeros(size, dtype=torch.int64),
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=dev),
            num_decode=size,
            block_tables=zeros(size, self.max_blocks, dtype=torch.int32),
            seq_lens=torch.ones(size, dtype=torch.int32, device=dev),
            cu_seqlens=zeros(1, dtype=torch.int32),
            logits_indices=torch.arange(size, dtype=torch.int64, device=dev),
            max_position=self.max_position,
        )

        def step() -> torch.Tensor:
            return self.model.forward_paged(static, self.caches, self.backend)

        # Run once outside the capture on a side stream (Triton compiles and loads its kernels,
        # the caching allocator warms up), as torch.cuda.graphs asks.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        self._graphs[size] = _Captured(graph, static, logits)
        return self._graphs[size]
