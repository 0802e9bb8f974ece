"""zero-moe: DeepSpeed's Mixture-of-Experts layer with expert parallelism, for the zero family.

``MoE`` is the layer; ``groups`` builds the expert-parallel process groups;
``reduce_moe_gradients`` averages gradients for data-parallel training without an engine;
``save_moe_checkpoint``/``load_moe_checkpoint`` store one file per global expert.
"""

from zero_moe.checkpoint import load_moe_checkpoint, save_moe_checkpoint
from zero_moe.dispatch import MOELayer, all_to_all
from zero_moe.experts import Experts
from zero_moe.gating import GateOutput, TopKGate, compute_capacity, topk_gating
from zero_moe.grad_reduce import reduce_moe_gradients
from zero_moe.layer import MoE
from zero_moe.utils import (
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_moe_and_non_moe_params,
    split_params_into_different_moe_groups_for_optimizer,
)
from zero_moe.version import __version__

__all__ = [
    "Experts",
    "GateOutput",
    "MOELayer",
    "MoE",
    "TopKGate",
    "__version__",
    "all_to_all",
    "compute_capacity",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "load_moe_checkpoint",
    "reduce_moe_gradients",
    "save_moe_checkpoint",
    "split_moe_and_non_moe_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "topk_gating",
]
