"""bench_max_model's results file and plot: the searches' limits beside the estimator's predictions."""

from __future__ import annotations

from _limit_search import SearchResult

GIB = 2**30
SYSTEM_NAMES = {"zero": "zero", "deepspeed": "DeepSpeed", "fsdp2": "FSDP2"}
BOUND_TEXT = {
    "memory": "the next size up went over the ceiling",
    "cap": "reached --max-layers (not memory-bound below it)",
    "failed": "stopped: the next size failed (see the trials)",
    "timeout": "stopped: the next size ran past --trial-timeout",
    "disk": "stopped: not enough free disk for the next size",
    "low-memory": "stopped: the machine kept running low on memory (other processes)",
}


def _m(params: float | None) -> str:
    return "-" if params is None else f"{params / 1e6:.1f}M"


def summarize(searches: list[dict], params_of) -> list[dict]:
    """One row per search: limit and prediction (blocks, parameters), the best trial's figures."""
    rows = []
    for s in searches:
        res: SearchResult = s["result"]
        best = res.best()
        rows.append(
            {
                "system": s["system"],
                "mode": s["mode"],
                "limit": res.limit,
                "limit_params": params_of(res.limit) if res.limit else 0,
                "prediction": res.prediction,
                "prediction_params": params_of(res.prediction) if res.prediction else None,
                "bound": res.bound,
                "peak": best.peak if best else None,
                "step_s": max(best.info.get("step_s", [0])) if best else None,
                "trials": len(res.trials),
                "seconds": sum(t.seconds for t in res.trials),
                "lower_bound": res.bound not in ("memory",),
            }
        )
    return rows


def matrix_table(rows: list[dict], modes: list[str]) -> list[str]:
    """Modes down, systems across: measured parameters (the estimator's prediction)."""
    systems = [s for s in SYSTEM_NAMES if any(r["system"] == s for r in rows)]
    out = [
        "| mode | " + " | ".join(f"{SYSTEM_NAMES[s]}: measured (predicted)" for s in systems) + " |",
        "|---|" + "---|" * len(systems),
    ]
    for mode in modes:
        cells = []
        for s in systems:
            r = next((r for r in rows if r["system"] == s and r["mode"] == mode), None)
            if r is None:
                cells.append("n/a")
                continue
            ge = ">= " if r["lower_bound"] and r["limit"] else ""
            cells.append(f"{ge}{_m(r['limit_params'])} ({_m(r['prediction_params'])})")
        if any(c != "n/a" for c in cells):
            out.append(f"| {mode} | " + " | ".join(cells) + " |")
    return out


def detail_table(rows: list[dict]) -> list[str]:
    out = [
        "| system | mode | limit: blocks / params | estimator's prediction: blocks / params | "
        "peak RSS at the limit (GiB, sum of ranks) | step time at the limit (s) | trials | search time (s) | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak'] / GIB:.2f}" if r["peak"] else "-"
        step = f"{r['step_s']:.1f}" if r["step_s"] else "-"
        out.append(
            f"| {SYSTEM_NAMES[r['system']]} | {r['mode']} | {r['limit']} / {_m(r['limit_params'])} | "
            f"{r['prediction'] if r['prediction'] is not None else '-'} / {_m(r['prediction_params'])} | {peak} | "
            f"{step} | {r['trials']} | {r['seconds']:.0f} | {BOUND_TEXT.get(r['bound'], r['bound'])} |"
        )
    return out


def trials_table(searches: list[dict]) -> list[str]:
    out = [
        "| system | mode | blocks | params | status | sum of peak RSS (GiB) | max sampled sum of RSS / anon (GiB) | "
        "cgroup peak (GiB) | wall (s) | build / init / slowest step (s) | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in searches:
        for t in s["result"].trials:
            i = t.info

            def gib(key: str, i=i) -> str:
                return f"{i[key] / GIB:.2f}" if i.get(key) else "-"

            times = (
                f"{i['build_s']:.1f} / {i['init_s']:.1f} / {max(i['step_s']):.1f}" if i.get("step_s") else "-"
            )
            note = (i.get("reason") or "").replace("|", "/")[:160]
            out.append(
                f"| {SYSTEM_NAMES[s['system']]} | {s['mode']} | {t.layers} | {_m(i.get('params'))} | {t.status} | "
                f"{gib('peak')} | {gib('peak_rss_sum')} / {gib('peak_anon_sum')} | {gib('cgroup_peak')} | "
                f"{t.seconds:.0f} | {times} | {note} |"
            )
    return out


def plot(rows: list[dict], modes: list[str], ceiling: int, path: str, title: str) -> None:
    """Grouped bars of the measured limits per mode and system, the predictions as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in SYSTEM_NAMES if any(r["system"] == s for r in rows)]
    modes = [m for m in modes if any(r["mode"] == m for r in rows)]
    colors = {"zero": "tab:blue", "deepspeed": "tab:orange", "fsdp2": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(8, 1.25 * len(modes) + 2), 5))
    width = 0.8 / len(systems)
    for k, s in enumerate(systems):
        for j, mode in enumerate(modes):
            r = next((r for r in rows if r["system"] == s and r["mode"] == mode), None)
            if r is None:
                continue
            x = j + (k - (len(systems) - 1) / 2) * width
            h = r["limit_params"] / 1e6
            ax.bar(
                x,
                h,
                width * 0.95,
                color=colors[s],
                hatch="//" if r["lower_bound"] else None,
                label=SYSTEM_NAMES[s]
                if j
                == min(
                    i for i, m in enumerate(modes) if any(q["system"] == s and q["mode"] == m for q in rows)
                )
                else None,
            )
            ax.text(x, h, f"{h:.0f}", ha="center", va="bottom", fontsize=7)
            if r["prediction_params"]:
                ax.plot(x, r["prediction_params"] / 1e6, marker="_", color="black", markersize=14, mew=2)
    ax.plot(
        [],
        [],
        marker="_",
        color="black",
        linestyle="none",
        markersize=14,
        mew=2,
        label="estimator's prediction",
    )
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels(modes, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("largest GPT that trains (M parameters)")
    ax.set_title(f"{title}\nceiling {ceiling / GIB:.2f} GiB (sum of 2 ranks' peak RSS); hatched: lower bound")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    from zero_core.checkpoint.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
