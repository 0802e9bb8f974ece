"""``python -m zero_core.launcher``: the ``zero`` command without the console script."""

import sys

from zero_core.launcher.cli import main

sys.exit(main())
