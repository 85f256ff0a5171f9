"""Tensor parallelism over torch.distributed: one model split across N processes, one GPU (or CPU process) each.

`parallel`: the process group (`TPGroup`), its collectives and the divisibility check; `layers`: the
column- and row-parallel linear layers the Llama model is built from; `worker`: the processes rank 0
starts (or torchrun starts), the loop they run, and the step metadata rank 0 sends them.
See docs/tensor_parallel.md.
"""

from pagedref.distributed.layers import ColumnParallelLinear, RowParallelLinear
from pagedref.distributed.parallel import TPGroup, check_tensor_parallel_size, destroy_tp_group, init_tp_group

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPGroup",
    "check_tensor_parallel_size",
    "destroy_tp_group",
    "init_tp_group",
]
