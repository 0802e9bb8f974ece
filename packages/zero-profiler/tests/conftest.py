"""Makes the shared test modules (profiler_models.py) importable under --import-mode=importlib."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
