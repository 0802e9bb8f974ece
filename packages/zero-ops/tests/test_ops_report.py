"""op_report(): the contract ``zero env`` relies on."""

from __future__ import annotations

from zero_ops import _native, op_report


def test_op_report_shape_and_content():
    report = op_report()
    names = [r["name"] for r in report]
    assert names == ["cpu_adam", "cpu_adagrad", "cpu_lion", "async_io"]
    for entry in report:
        assert set(entry) == {"name", "status", "isa", "reason"}
        assert entry["status"] in ("compiled", "fallback")
        assert all(isinstance(v, str) and v for v in entry.values())
    C = _native.native()
    if C is not None:
        assert report[0]["status"] == "compiled"
        assert C.isa() in C.compiled_isas() and C.cpu_supports(C.isa())
        assert "variants built" in report[0]["reason"]
    else:
        assert report[0]["reason"] == _native.fallback_reason()
