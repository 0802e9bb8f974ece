#!/usr/bin/env python
"""Convert a DeepSpeed checkpoint folder into a zero checkpoint: ``from_deepspeed.py DS_DIR OUT_DIR [--tag T]``."""

import sys

from zero_core.checkpoint.deepspeed_import import main

if __name__ == "__main__":
    sys.exit(main())
