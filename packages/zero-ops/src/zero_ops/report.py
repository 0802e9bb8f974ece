"""``op_report()``: which native ops are compiled, which ISA runs, and why (``zero env`` prints it)."""

from __future__ import annotations

from zero_ops import _native

OPTIMIZER_OPS = ("cpu_adam", "cpu_adagrad", "cpu_lion")


def op_report() -> list[dict[str, str]]:
    """One dict per native op: ``{name, status: "compiled"|"fallback", isa, reason}``."""
    C = _native.native()
    report: list[dict[str, str]] = []
    if C is None:
        reason = _native.fallback_reason()
        for name in OPTIMIZER_OPS:
            report.append({"name": name, "status": "fallback", "isa": "torch", "reason": reason})
        report.append(
            {
                "name": "async_io",
                "status": "fallback",
                "isa": "python threads (buffered pread/pwrite)",
                "reason": reason,
            }
        )
        return report
    isa = C.isa()
    label = C.generic_label() if isa == "generic" else isa
    supported = [n for n in C.compiled_isas() if C.cpu_supports(n)]
    threads = "OpenMP threads" if C.built_with_openmp() else "single-threaded (built without OpenMP)"
    reason = (
        f"{C.isa_reason()}; variants built: {', '.join(C.compiled_isas())}; "
        f"CPU supports: {', '.join(supported)}; {threads}"
    )
    for name in OPTIMIZER_OPS:
        report.append({"name": name, "status": "compiled", "isa": label, "reason": reason})
    report.append(_async_io_entry(C))
    return report


def _async_io_entry(C) -> dict[str, str]:
    """Which backend ``AsyncIOHandle(engine="auto")`` gets here, and why (see [Note: aio backends])."""
    direct = "O_DIRECT for 4 KiB-aligned blocks where the file system allows it, buffered I/O otherwise"
    if not C.libaio_compiled():
        return {
            "name": "async_io",
            "status": "compiled",
            "isa": "threads (pread/pwrite) + O_DIRECT",
            "reason": f"{C.libaio_probe()}; thread-pool backend; {direct}",
        }
    problem = C.libaio_probe()
    if problem:
        return {
            "name": "async_io",
            "status": "compiled",
            "isa": "threads (pread/pwrite) + O_DIRECT",
            "reason": f"built with libaio but kernel AIO is unusable here ({problem}); thread-pool backend; "
            f"{direct}",
        }
    return {
        "name": "async_io",
        "status": "compiled",
        "isa": "libaio (kernel AIO) + O_DIRECT",
        "reason": f"built with libaio and io_setup works here; {direct}",
    }
