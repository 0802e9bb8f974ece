"""fp32 consolidation of ZeRO checkpoints (deepspeed.utils.zero_to_fp32), from zero-core.

Also runnable as DeepSpeed's is: ``python -m zero.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT``.
"""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.utils.zero_to_fp32", "zero_core.checkpoint.zero_to_fp32")

if __name__ == "__main__":
    import sys

    from zero_core.checkpoint.zero_to_fp32 import main

    sys.exit(main())
