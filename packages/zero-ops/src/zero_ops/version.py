"""Version of the zero-ops distribution (the single place it is set)."""

__version__ = "0.1.0"
