"""``zero env``: what is installed and usable, like DeepSpeed's ``ds_report``.

The report is built as data first (``collect_report``) so it can be printed as text or JSON
and tested without parsing the text.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
from typing import Any

from zero_core.plugins import installed_family, is_available


def _native_ops() -> dict[str, Any]:
    if not is_available("zero_ops"):
        return {"installed": False, "message": "zero-ops not installed", "ops": []}
    try:
        zero_ops = importlib.import_module("zero_ops")
    except Exception as exc:  # a broken install is worth reporting, not crashing on
        return {
            "installed": True,
            "message": f"zero-ops is installed but failed to import: {exc!r}",
            "ops": [],
        }
    report = getattr(zero_ops, "op_report", None)
    if report is None:
        return {"installed": True, "message": "zero-ops installed (it provides no op_report())", "ops": []}
    try:
        ops = [dict(op) for op in report()]
    except Exception as exc:
        return {"installed": True, "message": f"zero_ops.op_report() failed: {exc!r}", "ops": []}
    return {"installed": True, "message": f"{len(ops)} op(s)", "ops": ops}


def _accelerator() -> dict[str, Any]:
    try:
        from zero_core.accelerator import get_accelerator

        acc = get_accelerator()
        return {
            "name": type(acc).__name__,
            "device": str(acc.device_name()),
            "device_count": int(acc.device_count()),
            "communication_backend": acc.communication_backend_name(),
        }
    except Exception as exc:
        return {"name": "unavailable", "error": repr(exc)}


def _backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }


def _cuda() -> dict[str, Any]:
    """CUDA devices as torch sees them: count, name and compute capability of each, and the
    NCCL version torch was built with (what a GPU job needs to know before it launches)."""
    import torch

    out: dict[str, Any] = {"available": False, "device_count": 0, "devices": [], "nccl_version": None}
    try:
        if not torch.cuda.is_available():
            return out
        out["available"] = True
        out["device_count"] = torch.cuda.device_count()
        for i in range(out["device_count"]):
            major, minor = torch.cuda.get_device_capability(i)
            out["devices"].append(
                {"index": i, "name": torch.cuda.get_device_name(i), "compute_capability": f"{major}.{minor}"}
            )
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        out["nccl_version"] = ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else nccl
    except Exception as exc:  # a broken driver is worth reporting, not crashing on
        out["error"] = repr(exc)
    return out


def _mpi() -> dict[str, Any]:
    from zero_core.launcher.run import LaunchError, find_mpiexec

    out: dict[str, Any] = {}
    try:
        out["mpiexec"] = find_mpiexec()
    except LaunchError:
        out["mpiexec"] = None
    try:
        import mpi4py

        out["mpi4py"] = mpi4py.__version__
        # Read the library version without MPI_Init (which a report must not do).
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI

        out["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    except ImportError:
        out.setdefault("mpi4py", None)
        out["mpi_library"] = None
    except Exception as exc:  # mpi4py without a loadable libmpi
        out["mpi_library"] = f"not loadable ({exc}); pip install mpich"
    return out


def collect_report() -> dict[str, Any]:
    """Everything ``zero env`` prints, as a JSON-friendly dict."""
    import torch

    family = installed_family()
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": {
            "version": torch.__version__,
            "path": os.path.dirname(torch.__file__),
            "cuda": torch.version.cuda,
        },
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "zero_family": family,
        "native_ops": _native_ops(),
        "accelerator": _accelerator(),
        "distributed_backends": _backends(),
        "cuda_devices": _cuda(),
        "mpi": _mpi(),
    }


def _line(name: str, value: Any, width: int = 30) -> str:
    return f"{name} {'.' * max(2, width - len(name))} {value}"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`collect_report`."""
    rule = "-" * 72
    lines = [rule, "zero environment report", rule]
    lines.append(_line("python", f"{report['python']['version']} ({report['python']['executable']})"))
    t = report["torch"]
    lines.append(_line("torch", f"{t['version']} ({t['path']})"))
    lines.append(_line("torch cuda", t["cuda"] or "none (CPU build)"))
    lines.append(_line("platform", report["platform"]))
    lines.append(_line("cpus", report["cpus"]))
    lines.append(_line("OMP_NUM_THREADS", report["omp_num_threads"] or "unset"))
    lines += [rule, "zero family", rule]
    for dist_name, version in report["zero_family"].items():
        lines.append(_line(dist_name, version or "not installed"))
    lines += [rule, "native ops (zero-ops)", rule]
    ops = report["native_ops"]
    if not ops["ops"]:
        lines.append(ops["message"])
    for op in ops["ops"]:
        extra = ", ".join(f"{k}={op[k]}" for k in ("isa", "reason") if op.get(k))
        lines.append(
            _line(str(op.get("name", "?")), f"{op.get('status', '?')}" + (f" ({extra})" if extra else ""))
        )
    lines += [rule, "accelerator", rule]
    for key, value in report["accelerator"].items():
        lines.append(_line(key, value))
    lines += [rule, "distributed", rule]
    for name, ok in report["distributed_backends"].items():
        lines.append(_line(f"backend {name}", "available" if ok else "not available"))
    cuda = report["cuda_devices"]
    lines.append(_line("NCCL version", cuda["nccl_version"] or "none"))
    lines.append(_line("CUDA devices", cuda["device_count"] if cuda["available"] else "none"))
    for dev in cuda["devices"]:
        lines.append(
            _line(f"  cuda:{dev['index']}", f"{dev['name']} (compute capability {dev['compute_capability']})")
        )
    if "error" in cuda:
        lines.append(_line("CUDA error", cuda["error"]))
    mpi = report["mpi"]
    lines.append(_line("mpi4py", mpi.get("mpi4py") or "not installed (pip install mpi4py mpich)"))
    lines.append(_line("MPI library", mpi.get("mpi_library") or "none"))
    lines.append(_line("mpiexec", mpi.get("mpiexec") or "not found (pip install mpich)"))
    lines.append(rule)
    return "\n".join(lines)
