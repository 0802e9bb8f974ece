"""Re-slicing a saved TP-sharded checkpoint for a different ``tp_size``.

[Note: re-sharding a TP checkpoint]
``save_mp_checkpoint_path`` records, next to each rank's state dict, how every sharded tensor
was cut (``layouts`` in ``zero_inference_tp.json``) and its unsharded shape (``shapes``):

* ``column`` (``blocks`` fused blocks; ``transposed`` for HF ``Conv1D``): rank ``r`` holds, in
  ``[out, in]`` orientation, rows ``[b*B + r*p, b*B + (r+1)*p)`` of every block ``b``
  (``B = out / blocks``, ``p = B / tp_size``); biases the same rows. Fused projections whose
  parts differ in size or are kept whole (multi-query key/value) record ``segments``
  ``[[size, split], ...]`` instead: rank ``r`` holds its slice of each split segment and all of
  each replicated one, one segment after another;
* ``row``: rank ``r`` holds input columns ``[r*q, (r+1)*q)``, stored ``[out, in/tp_size]``;
  its bias is replicated; with ``blocks`` (CodeGen's ``out_proj``, see [Note: grouped fused
  q/k/v] in auto_tp.py) its part of each of ``blocks`` equal column blocks, one after another;
* ``vocab`` (input embedding, LM head and its bias): rank ``r`` holds rows
  ``[r*per, (r+1)*per)`` of the vocabulary padded with zero rows to ``per = ceil(V / tp_size)``;
* anything else is replicated (read from rank 0's file).

:class:`TPReshardSource` inverts this: it presents every tensor in the *original* model's layout
(the one an unsharded model, e.g. built by :func:`zero_inference.empty_model`, has), so the
engine loads it exactly like a full checkpoint (replicated tensors whole, sharded ones sliced
for the new ``tp_size`` by ``apply_plan``). A requested slice is cut from the old shards that
overlap it, each read with safetensors' ranged ``get_slice``: a rank reads the saved bytes of
its new shard (and, for a fused projection or a row that straddles old shards, those shards'
overlapping parts), never a whole tensor it then cuts, except for replicated tensors.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from zero_inference.param_source import column_segments

if TYPE_CHECKING:
    from zero_inference.auto_tp import TPPlan


def plan_layouts(
    plan: TPPlan, shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, dict], dict[str, list[int]]]:
    """(``layouts``, ``shapes``) entries of the index for the tensors ``plan`` shards."""
    layouts: dict[str, dict] = {}
    out_shapes: dict[str, list[int]] = {}

    def add(name: str, layout: dict) -> None:
        if name in shapes:
            layouts[name] = layout
            out_shapes[name] = list(shapes[name])

    if plan is None:
        return layouts, out_shapes
    for mod, spec in plan.column.items():
        t = mod in plan.transposed
        cut = {"blocks": spec} if isinstance(spec, int) else {"segments": [list(seg) for seg in spec]}
        add(f"{mod}.weight", {"kind": "column", **cut, "transposed": t})
        add(f"{mod}.bias", {"kind": "column", **cut, "transposed": False})
    for mod in plan.row:
        blocks = plan.row_blocks.get(mod, 1)
        add(
            f"{mod}.weight",
            {
                "kind": "row",
                "transposed": mod in plan.transposed,
                **({"blocks": blocks} if blocks > 1 else {}),
            },
        )
    for mod in plan.embeddings:
        add(f"{mod}.weight", {"kind": "vocab"})
    if plan.lm_head is not None:
        add(f"{plan.lm_head}.weight", {"kind": "vocab"})
        add(f"{plan.lm_head}.bias", {"kind": "vocab"})
    return layouts, out_shapes


class TPReshardSource:
    """The tensors of a saved TP checkpoint in the unsharded layout. See [Note: re-sharding a TP checkpoint]."""

    def __init__(self, path: str, index: dict[str, Any]) -> None:
        if "layouts" not in index:
            raise ValueError(
                f"TP checkpoint {path} (format version {index.get('version')}) records no shard layouts, so it "
                f"can only be loaded with tp_size={index.get('tp_size')}; save it again with this zero-inference"
            )
        self.path = path
        self.old_world = int(index["tp_size"])
        self.layouts: dict[str, dict] = index["layouts"]
        self.shapes = {k: tuple(v) for k, v in index["shapes"].items()}
        self.aliases: dict[str, str] = index.get("aliases", {})
        self._files = [safe_open(os.path.join(path, f), framework="pt") for f in index["files"]]
        self._names = set(self._files[0].keys()) | set(self.aliases)

    def _stored(self, name: str) -> str:
        return self.aliases.get(name, name)

    def _slice(self, rank: int, name: str):  # noqa: ANN202 (safetensors' PySafeSlice)
        return self._files[rank].get_slice(self._stored(name))

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.shapes:
            return self.shapes[name]
        if name not in self._names:
            raise KeyError(f"TP checkpoint {self.path} has no tensor named {name!r}")
        return tuple(self._slice(0, name).get_shape())

    # -- the unsharded index space ------------------------------------------------------
    def _segmented(self, name: str, start: int, stop: int, segments: Any, cols: bool) -> torch.Tensor:
        """Indices ``[start, stop)`` of the unsharded dimension cut into ``segments`` (rows of a
        column-sharded tensor, or input columns of a row-sharded one, in ``[out, in]`` orientation)."""
        parts, seg_start, local_start = [], 0, 0  # a segment's first index, unsharded and in a shard
        for size, split in segments:
            per = size // self.old_world if split else size
            idx, end = max(start, seg_start), min(stop, seg_start + size)
            while idx < end:
                old_rank, off = divmod(idx - seg_start, per) if split else (0, idx - seg_start)
                take = min(end - idx, per - off)
                local = local_start + off  # an old rank stores its part of each segment one after another
                shard = self._slice(old_rank, name)
                parts.append(shard[:, local : local + take] if cols else shard[local : local + take])
                idx += take
            seg_start += size
            local_start += per
        return torch.cat(parts, dim=1 if cols else 0)

    def _column_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the ``[out, ...]`` orientation of a column-sharded tensor."""
        lay, shape = self.layouts[name], self.shape(name)
        out = shape[-1] if lay["transposed"] else shape[0]
        segments = column_segments(lay["segments"] if "segments" in lay else lay["blocks"], out)
        return self._segmented(name, start, stop, segments, cols=False)

    def _row_cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Input columns ``[start, stop)`` (``[out, in]`` orientation) of a row-sharded weight."""
        lay, shape = self.layouts[name], self.shape(name)
        width = shape[0] if lay["transposed"] else shape[1]
        return self._segmented(name, start, stop, column_segments(lay.get("blocks", 1), width), cols=True)

    def _vocab_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        per = -(-self.shape(name)[0] // self.old_world)
        parts, row = [], start
        while row < stop:
            old_rank, off = divmod(row, per)
            take = min(stop - row, per - off)
            parts.append(self._slice(old_rank, name)[off : off + take])
            row += take
        return torch.cat(parts, dim=0)

    # -- ParamSource --------------------------------------------------------------------
    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        lay = self.layouts.get(name)
        if lay is None:
            return self._slice(0, name)[start:stop]
        if lay["kind"] == "vocab":
            return self._vocab_rows(name, start, stop)
        if lay["kind"] == "column" and not lay["transposed"]:
            return self._column_rows(name, start, stop)
        if lay["kind"] == "row" and lay["transposed"]:  # Conv1D [in, out]: rows are input features
            return self._row_cols(name, start, stop).t()
        return self.full(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        lay = self.layouts.get(name)
        if lay is None:
            return self._slice(0, name)[:, start:stop]
        if lay["kind"] == "column" and lay["transposed"]:  # Conv1D [in, out]: columns are outputs
            return self._column_rows(name, start, stop).t()
        if lay["kind"] == "row" and not lay["transposed"]:
            return self._row_cols(name, start, stop)
        return self.full(name)[:, start:stop]

    def full(self, name: str) -> torch.Tensor:
        lay = self.layouts.get(name)
        if lay is None:
            if name not in self._names:
                raise KeyError(f"TP checkpoint {self.path} has no tensor named {name!r}")
            return self._files[0].get_tensor(self._stored(name))
        shape = self.shape(name)
        if lay["kind"] == "vocab":
            return self._vocab_rows(name, 0, shape[0])
        if lay["kind"] == "column":
            rows = self._column_rows(name, 0, shape[-1] if lay["transposed"] else shape[0])
            return rows.t().contiguous() if lay["transposed"] else rows
        width = shape[0] if lay["transposed"] else shape[1]
        w = self._row_cols(name, 0, width)
        return w.t().contiguous() if lay["transposed"] else w
