"""Reading DeepSpeed's pickled checkpoint files without running code from them.

[Note: reading DeepSpeed pickles safely]
DeepSpeed saves with ``torch.save``: a zip holding ``data.pkl`` (a pickle) and the raw tensor
storages. A pickle is a program: ``GLOBAL module name`` fetches any importable object and
``REDUCE`` calls it, so loading a pickle from elsewhere with plain ``pickle``/``torch.load``
runs whatever its author chose. We never do that. Two gates:

1. Before anything is unpickled, the opcodes of ``data.pkl`` are listed (``pickletools``,
   which only parses) and every global they name must be on :data:`ALLOWED_GLOBALS`: torch's
   tensor rebuild functions, storages, ``torch.Size``/dtypes/devices, ``OrderedDict``, and the
   four DeepSpeed classes its checkpoints hold (the loss scalers, ``ZeroStageEnum``,
   ``fragment_address``). Any other name stops the read with a :class:`CheckpointError`
   naming it; nothing was executed.
2. The file is then read by ``torch.load(weights_only=True)``, torch's own restricted
   unpickler, with the DeepSpeed names mapped (``torch.serialization.safe_globals`` with
   ``(stand-in, "deepspeed...Name")`` pairs, torch >= 2.6) to the plain stand-ins below:
   classes with no behaviour whose instances only receive the pickled attribute dict, and a
   function turning ``ZeroStageEnum(2)`` into the int 2. DeepSpeed itself is never imported.
   Anything the first gate let through that torch does not allow is still refused by torch.

The stand-ins keep what the converter needs (a loss scaler's ``cur_scale``, ``cur_iter``...);
``mmap=True`` maps the tensor storages instead of reading them, so a large file costs the
pages the converter touches, not its size.
"""

from __future__ import annotations

import pickletools
import re
import zipfile
from typing import Any

import torch

from zero_core.checkpoint.format import CheckpointError


class DeepSpeedLossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (static scale): attributes only."""

    dynamic_kind = False

    def fields(self) -> dict[str, Any]:
        return dict(vars(self))


class DeepSpeedDynamicLossScaler(DeepSpeedLossScaler):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``: attributes only."""

    dynamic_kind = True


class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (numel, start)."""

    def __repr__(self) -> str:
        return f"FragmentAddress({vars(self)})"


def zero_stage_value(value: Any) -> int:
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum(value)``: the stage as an int."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
        raise CheckpointError(f"ZeroStageEnum holds {value!r}, expected a ZeRO stage 0-3")
    return value


#: DeepSpeed's names -> the stand-ins they are read as (see [Note: reading DeepSpeed pickles safely]).
DEEPSPEED_STAND_INS: dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": DeepSpeedLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DeepSpeedDynamicLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": zero_stage_value,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

_TORCH_STORAGES = {
    f"torch.{kind}Storage"
    for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
}
_TORCH_DTYPES = {
    f"torch.{name}"
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}
#: Every global a DeepSpeed checkpoint file may name; anything else is refused before unpickling.
ALLOWED_GLOBALS: frozenset[str] = frozenset(
    {
        "collections.OrderedDict",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._tensor._rebuild_from_type_v2",  # a tensor with attributes (stage 3's ds_id on its flat groups)
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "torch.Size",
        "torch.device",
        "torch.storage.UntypedStorage",
        "builtins.set",
        "builtins.frozenset",
    }
    | _TORCH_STORAGES
    | _TORCH_DTYPES
    | set(DEEPSPEED_STAND_INS)
)

_STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "UNICODE",
    "BINUNICODE8",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
}


def pickle_globals(data: bytes, where: str) -> list[str]:
    """Every ``module.name`` the pickle ``data`` refers to, found by parsing only (nothing runs)."""
    found = []
    recent: list[str] = []  # the last strings pushed: the operands of a STACK_GLOBAL
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                found.append(f"{module}.{name}")
            elif op.name == "STACK_GLOBAL":
                found.append(
                    f"{recent[-2]}.{recent[-1]}" if len(recent) >= 2 else "<a global built at run time>"
                )
            if op.name in _STRING_OPS:
                recent = (recent + [str(arg)])[-2:]
            elif op.name not in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                recent = []
    except Exception as e:  # a malformed stream: refuse it, as an unpickler would
        raise CheckpointError(
            f"{where}: its pickle is malformed ({e}); not a DeepSpeed checkpoint file"
        ) from None
    return found


def _pickle_bytes(path: str) -> bytes | None:
    """The ``data.pkl`` of a ``torch.save`` zip file; None for the legacy (non-zip) format."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            raise CheckpointError(
                f"{path} is a zip file but not one written by torch.save (no single data.pkl)"
            )
        return z.read(names[0])


def _refuse(path: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"{path} refers to {name}, which is not on the allow-list of a DeepSpeed checkpoint file; it was not "
        "unpickled and nothing in it was run. Allowed: torch tensors and storages, OrderedDict, and "
        f"{', '.join(sorted(DEEPSPEED_STAND_INS))}. If you trust the file, load it with torch.load yourself "
        "and save what it holds in a plain form"
    )


def check_globals(path: str) -> None:
    """Raise :class:`CheckpointError` naming the first global of ``path`` that is not allowed."""
    data = _pickle_bytes(path)
    if data is None:
        return  # legacy format: torch's restricted unpickler alone guards it (see load_deepspeed_file)
    for name in pickle_globals(data, path):
        if name not in ALLOWED_GLOBALS:
            raise _refuse(path, name)


def _torch_supports_named_safe_globals() -> bool:
    major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    return (major, minor) >= (2, 6)


def load_deepspeed_file(path: str) -> Any:
    """The object ``torch.save`` stored in ``path``, read without running code from it.

    See [Note: reading DeepSpeed pickles safely]. Raises :class:`CheckpointError` naming the
    file and, for a refused global, its name.
    """
    if not _torch_supports_named_safe_globals():
        raise CheckpointError(
            f"importing a DeepSpeed checkpoint needs torch >= 2.6 (its safe_globals with named stand-ins); "
            f"this is torch {torch.__version__}"
        )
    check_globals(path)
    pairs = [(obj, name) for name, obj in DEEPSPEED_STAND_INS.items()]
    try:
        with torch.serialization.safe_globals(pairs):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # legacy format: no mmap
    except Exception as e:
        if isinstance(e, CheckpointError):
            raise
        m = re.search(r"GLOBAL ([\w.]+)", str(e))
        if m:
            raise _refuse(path, m.group(1)) from None
        raise CheckpointError(
            f"{path} cannot be read as a torch.save file: {type(e).__name__}: {e}"
        ) from None
