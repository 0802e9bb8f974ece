"""Human-readable numbers for profiles: ``12.35 G``, ``3.1 GMACs``, ``4.2 ms``."""

from __future__ import annotations

_PREFIXES = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``num`` scaled to a decimal prefix (``T``, ``G``, ``M``, ``K`` or none) with ``precision`` digits.

    ``units`` forces a prefix (one of ``"T"``, ``"G"``, ``"M"``, ``"K"``, ``""``).
    """
    if units is None:
        for scale, prefix in _PREFIXES:
            if abs(num) >= scale:
                return f"{round(num / scale, precision)} {prefix}"
        return f"{round(num, precision)} "
    scales = {prefix: scale for scale, prefix in _PREFIXES}
    scales[""] = 1.0
    if units not in scales:
        raise ValueError(f"units must be one of {sorted(scales)}, got {units!r}")
    return f"{round(num / scales[units], precision)} {units}"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(flops, units, precision)


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(macs, units, precision) + "MACs"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision).rstrip()


def flops_rate_to_string(flops_per_s: float, precision: int = 2) -> str:
    return number_to_string(flops_per_s, None, precision) + "FLOPS"


def duration_to_string(seconds: float, precision: int = 2) -> str:
    """Seconds as ``s``, ``ms`` or ``us`` with ``precision`` digits."""
    if seconds >= 1:
        return f"{round(seconds, precision)} s"
    if seconds >= 1e-3:
        return f"{round(seconds * 1e3, precision)} ms"
    return f"{round(seconds * 1e6, precision)} us"
