"""Tensor parallelism on torch.distributed: the group (``parallel_state``), its
collectives (``communication_op``) and the arithmetic of sharding (``utils``)."""

from vllm.distributed.communication_op import (
    broadcast,
    broadcast_object,
    broadcast_tensor_dict,
    min_over_ranks,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
)
from vllm.distributed.parallel_state import (
    TPGroup,
    destroy,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed,
    is_initialized,
)
from vllm.distributed.utils import divide, split_tensor_along_last_dim

__all__ = [
    "TPGroup",
    "broadcast",
    "broadcast_object",
    "broadcast_tensor_dict",
    "destroy",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed",
    "is_initialized",
    "min_over_ranks",
    "split_tensor_along_last_dim",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather",
]
