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

# zero_core's converter also reads zero-pipe's and zero-moe's weights-only directories: the reader
# (module_dirs.py) builds on the converter's, which must not import it (See [Note: standalone
# conversion script]), so it is handed over here, when the package is first imported.
from zero_core.checkpoint import module_dirs as _module_dirs  # noqa: E402
from zero_core.checkpoint import zero_to_fp32 as _zero_to_fp32  # noqa: E402

_zero_to_fp32.EXTRA_READERS.append(_module_dirs.open_module_dir)
