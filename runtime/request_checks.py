"""A request's checks where it enters an engine: its prompt and sampling fields against the engine's vocabulary,
lengths and pool, each failure a RequestError that names the field and the fix (sampling.SamplingParams checks
its own ranges when it is made)."""

from __future__ import annotations

from collections.abc import Sequence

from .block_manager import BlockManager
from .errors import RequestError
from .sampling import SamplingParams


def check_request(prompt_ids: Sequence[int], sp: SamplingParams, vocab: int, max_input_len: int, max_seq_len: int,
                  blocks: BlockManager) -> list[int]:
    """The prompt as a list of ints, or a RequestError: ids in [0, vocab) (prompt, stop ids, bad words, stop
    sequences), the prompt within max_input_len, prompt + max_tokens within max_seq_len and the pool."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise RequestError("the prompt is empty; send at least one token.")
    if min(ids) < 0 or max(ids) >= vocab:
        raise RequestError(f"prompt token ids must be in [0, {vocab}); check the tokenizer.")
    for name, seqs in (("stop_token_ids", [sp.stop_token_ids]), ("bad_words", sp.bad_words),
                       ("stop_sequences", sp.stop_sequences)):
        bad = [t for s in seqs for t in s if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{name} holds token id(s) {bad[:4]} outside [0, {vocab}); fix the request field.")
    if len(ids) > max_input_len:
        raise RequestError(
            f"the prompt has {len(ids)} tokens, the engine accepts at most {max_input_len} "
            "(max_input_len in engine.json); shorten it or rebuild the engine with a larger max_input_len."
        )
    total = len(ids) + sp.max_tokens
    if total > max_seq_len:
        raise RequestError(
            f"max_tokens must be in [1, {max_seq_len - len(ids)}] for a {len(ids)}-token prompt: "
            f"prompt + max_tokens ({sp.max_tokens}) = {total} exceeds max_seq_len {max_seq_len}; "
            "shorten the prompt or lower max_tokens."
        )
    if blocks.blocks_for(total) > blocks.num_blocks:
        raise RequestError(
            f"a request of {total} tokens needs {blocks.blocks_for(total)} KV blocks but the pool has "
            f"{blocks.num_blocks}; lower max_tokens or give the engine more KV memory."
        )
    return ids
