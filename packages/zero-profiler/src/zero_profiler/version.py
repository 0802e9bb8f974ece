"""Version of the zero-profiler distribution (the single place it is set)."""

__version__ = "0.1.0"
