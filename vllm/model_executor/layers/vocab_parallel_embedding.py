"""The token embedding and the LM head, sharded over the vocabulary, as vLLM's.

The vocabulary is padded to ``num_embeddings_padded``, a multiple of ``padding_size``
(64, vLLM's) and of the rank count, and split evenly: rank r holds the rows
``[vocab_start, vocab_end)`` of the padded table. Rows past the real vocabulary are zeros
(never looked up; their logits are cut off).

- ``VocabParallelEmbedding``: each rank looks up the ids in its range (the others read
  row 0 and are masked to zero), and one all-reduce sums the ranks' rows: every token's
  embedding from the one rank that holds it.
- ``ParallelLMHead``: the same table (or the embedding's, when tied) as the output
  projection; ``compute_logits`` multiplies by this rank's rows and gathers the ranks'
  logits along the vocabulary, on every rank or on rank 0 only (whoever samples), then
  drops the padding.

At world size 1 the lookup is ``F.embedding`` with no collective; the table carries its
padding rows (as vLLM's does), so its shape is ``(num_embeddings_padded, dim)``.
Parameters carry ``weight_loader(param, loaded_weight, shard_id=None)`` taking the FULL
checkpoint table (a tensor or a lazy safetensors slice), reading only this rank's rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from vllm.distributed.parallel_state import get_tp_group
from vllm.model_executor.layers.linear import check_full_shape, copy_into, read_range

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, padding_size: int, tp_size: int) -> int:
    """The smallest multiple of both ``padding_size`` and ``tp_size`` >= ``vocab_size``."""
    step = math.lcm(padding_size, tp_size)
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    ):
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1 or padding_size < 1:
            raise ValueError(
                f"num_embeddings={num_embeddings}, embedding_dim={embedding_dim} and "
                f"padding_size={padding_size} must be >= 1"
            )
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size, tp.world_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // tp.world_size
        self.vocab_start = tp.rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        # Rows of this shard that are real tokens (the rest is padding).
        self.num_real_rows = max(0, min(self.vocab_end, num_embeddings) - self.vocab_start)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype)
        )
        self.weight.weight_loader = self.weight_loader
        self.weight.full_shape = (num_embeddings, embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        """Rows ``[vocab_start, vocab_end)`` of the full (vocab, dim) table, or of a (vocab,)
        bias; padding rows become zeros."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id={shard_id!r}")
        full = (self.num_embeddings, self.embedding_dim)[: param.dim()]
        check_full_shape(loaded_weight, full, type(self).__name__)
        n = self.num_real_rows
        copy_into(param[:n], read_range(loaded_weight, 0, self.vocab_start, self.vocab_start + n))
        with torch.no_grad():
            param[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        rows = F.embedding(local_ids, self.weight)
        rows = rows.masked_fill(~in_shard.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(rows)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (padded {self.num_embeddings_padded}), "
            f"dim={self.embedding_dim}, rows=[{self.vocab_start}, {self.vocab_end}), "
            f"tp={self.tp_rank}/{self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over the sharded vocabulary; ``compute_logits`` runs it."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    ):
        super().__init__(num_embeddings, embedding_dim, dtype, padding_size)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition, dtype=dtype))
            self.bias.weight_loader = self.weight_loader
            self.bias.full_shape = (num_embeddings,)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """Use ``embedding``'s table as this head's weight (tied word embeddings)."""
        if (embedding.num_embeddings_padded, embedding.embedding_dim) != (
            self.num_embeddings_padded,
            self.embedding_dim,
        ) or (embedding.tp_rank, embedding.tp_size) != (self.tp_rank, self.tp_size):
            raise ValueError(f"cannot tie {self} to an embedding of another shape: {embedding}")
        self.weight = embedding.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding: call compute_logits(hidden)")

    def compute_logits(
        self, hidden_states: torch.Tensor, to_all_ranks: bool = True
    ) -> torch.Tensor | None:
        """fp32 logits (rows, num_embeddings) of final hidden states (rows, dim): on every
        rank, or (``to_all_ranks=False``) on rank 0 only, None on the others."""
        local = F.linear(hidden_states.to(self.weight.dtype), self.weight, self.bias).float()
        if to_all_ranks:
            logits = tensor_model_parallel_all_gather(local, dim=-1)
        else:
            logits = tensor_model_parallel_gather(local, dst=0, dim=-1)
            if logits is None:
                return None
        return logits[..., : self.num_embeddings]
