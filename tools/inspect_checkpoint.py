#!/usr/bin/env python
"""Print a zero checkpoint's tags, world size, stage, parameter count, dtypes, file sizes; verify checksums."""

import sys

from zero_core.checkpoint.inspect import main

if __name__ == "__main__":
    sys.exit(main())
