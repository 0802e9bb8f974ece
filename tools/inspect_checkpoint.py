#!/usr/bin/env python
"""Print a zero checkpoint's tags, world size, stage, parameter count, dtypes, file sizes; verify checksums.

Reads engine checkpoints (zero-pipe's too, with their pipeline layout) and the weights-only directories
of ``PipelineModule.save_state_dict`` and zero-moe's ``save_moe_checkpoint``."""

import sys

from zero_core.checkpoint.inspect import main

if __name__ == "__main__":
    sys.exit(main())
