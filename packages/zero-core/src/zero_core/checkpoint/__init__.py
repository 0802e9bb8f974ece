"""Safe, reshardable training checkpoints. See [Note: checkpoint format] in ``format.py``."""

from zero_core.checkpoint.deepspeed_import import from_deepspeed
from zero_core.checkpoint.format import CheckpointError
from zero_core.checkpoint.fragments import CheckpointableStrategy, CheckpointReader, Fragment
from zero_core.checkpoint.loader import load_checkpoint, open_checkpoint
from zero_core.checkpoint.saver import save_checkpoint
from zero_core.checkpoint.utils import clone_tensors_for_torch_save

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "CheckpointableStrategy",
    "Fragment",
    "clone_tensors_for_torch_save",
    "from_deepspeed",
    "load_checkpoint",
    "open_checkpoint",
    "save_checkpoint",
]
