#!/usr/bin/env python
"""Consolidate a zero checkpoint into an fp32 state dict: ``zero_to_fp32.py CHECKPOINT_DIR OUTPUT``.

Engine checkpoints (zero-pipe's pipelines and zero-moe's experts included) and the weights-only
directories of ``PipelineModule.save_state_dict`` and zero-moe's ``save_moe_checkpoint``."""

import sys

from zero_core.checkpoint.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
