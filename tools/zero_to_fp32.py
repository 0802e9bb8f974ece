#!/usr/bin/env python
"""Consolidate a zero checkpoint into an fp32 state dict: ``zero_to_fp32.py CHECKPOINT_DIR OUTPUT``."""

import sys

from zero_core.checkpoint.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
