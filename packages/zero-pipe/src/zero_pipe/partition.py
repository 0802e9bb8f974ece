"""Splitting a list of layers into contiguous pipeline stages."""

from __future__ import annotations

import re
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., num_items]`` giving each part ``num_items // num_parts`` items,
    the first ``num_items % num_parts`` parts one more."""
    if num_parts < 1 or num_items < num_parts:
        raise ValueError(f"cannot split {num_items} layers into {num_parts} non-empty stages")
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous boundaries minimising the heaviest part (ties: earlier parts lighter).

    Every part gets at least one item. Exact dynamic programme, O(n^2 p): layer lists are short.
    """
    n = len(weights)
    if num_parts < 1 or n < num_parts:
        raise ValueError(f"cannot split {n} layers into {num_parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        if w < 0:
            raise ValueError(f"partition weights must be >= 0, got {w}")
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-part weight splitting items[:i] into k parts; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def type_weights(layer_type_names: Sequence[str], regex: str) -> list[float]:
    """Weight 1 for layers whose class name matches ``regex`` (case-insensitive), else 0."""
    try:
        pattern = re.compile(regex, re.IGNORECASE)
    except re.error as err:
        raise ValueError(f"partition_method 'type:{regex}': invalid regular expression ({err})") from err
    weights = [1.0 if pattern.search(name) else 0.0 for name in layer_type_names]
    if not any(weights):
        raise ValueError(
            f"partition_method 'type:{regex}' matches no layer; layer types are {list(layer_type_names)}"
        )
    return weights
