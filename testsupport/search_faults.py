"""A tiny Llama whose training step cannot be compiled at chosen micro-batch sizes: the plan search's failures.

Its head count (3), layers (3) and an odd sequence leave one mesh on 2 devices (data=2), so the
search's candidates differ by micro-batches alone: 8 rows compile, 4 kill the compiling process
(as a fatal XLA check does) and 2 raise.
"""

from __future__ import annotations

import os

import transformers

ABORT_ROWS, RAISE_ROWS = 4, 2  # token-id rows one forward sees: batch 8 over 2 and 4 micro-batches


class FaultyLlama(transformers.LlamaForCausalLM):
    """A Llama whose forward, traced at ``ABORT_ROWS`` rows, aborts the process and, at ``RAISE_ROWS``, raises."""

    def forward(self, input_ids=None, **kwargs):
        rows = input_ids.shape[0]
        if rows == ABORT_ROWS:  # as XLA's fatal checks do: a glog line, then SIGABRT
            os.write(2, b"F1126 17:00:00.000000   42 hlo_instruction.cc:1] injected check failure\n")
            os.abort()
        if rows == RAISE_ROWS:
            raise RuntimeError(f"injected failure at {rows} rows")
        return super().forward(input_ids=input_ids, **kwargs)


def faulty_llama() -> FaultyLlama:
    """The factory (the CLI builds it on meta)."""
    sizes = {"hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 3, "num_key_value_heads": 3}
    return FaultyLlama(transformers.LlamaConfig(**sizes, intermediate_size=96, vocab_size=128, use_cache=False))
