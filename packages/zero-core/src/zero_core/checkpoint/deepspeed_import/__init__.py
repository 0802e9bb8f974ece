"""Import DeepSpeed checkpoint folders as zero checkpoints.

See [Note: importing a DeepSpeed checkpoint] in ``convert.py``; the files are read without
running code from them ([Note: reading DeepSpeed pickles safely] in ``safe_pickle.py``).
"""

from zero_core.checkpoint.deepspeed_import.convert import from_deepspeed, main
from zero_core.checkpoint.deepspeed_import.layout import find_checkpoint, is_deepspeed_checkpoint

__all__ = ["find_checkpoint", "from_deepspeed", "is_deepspeed_checkpoint", "main"]
