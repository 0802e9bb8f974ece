"""The one place zero-pipe reaches the communication layer.

Every collective and point-to-point op of the project goes through ``zero_core.comm`` (so
the comms logger sees it). That module mirrors torch.distributed's names and arguments; while
it is being written, any function it does not provide yet falls back to ``torch.distributed``.
Once it is complete, the fallback is dead code and can be deleted from this file alone.
"""

from __future__ import annotations

import torch.distributed as _torch_dist

try:
    from zero_core import comm as _comm
except ImportError:  # pragma: no cover - depends on the installed zero-core
    _comm = None


def _pick(name: str):
    fn = getattr(_comm, name, None) if _comm is not None else None
    return fn if fn is not None else getattr(_torch_dist, name)


ReduceOp = _torch_dist.ReduceOp
all_reduce = _pick("all_reduce")
broadcast = _pick("broadcast")
send = _pick("send")
recv = _pick("recv")
barrier = _pick("barrier")
get_rank = _pick("get_rank")
get_world_size = _pick("get_world_size")
new_group = _pick("new_group")
is_initialized = _pick("is_initialized")
