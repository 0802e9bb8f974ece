"""The printed profile: containers never called show the sum of their children."""

from __future__ import annotations

import re

import torch
import torch.nn as nn
from zero_profiler import FlopsProfiler
from zero_profiler.report import effective_stats


class Tower(nn.Module):
    """Iterates over a ModuleList itself: the list is never called."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(3))
        self.out = nn.Linear(8, 2, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def profiled(train: bool = False):
    model = Tower()
    prof = FlopsProfiler(model)
    prof.track_backward = train
    prof.start_profile()
    out = model(torch.randn(4, 8))
    if train:
        out.sum().backward()
    prof.stop_profile()
    return model, prof


def test_uncalled_container_sums_its_children():
    model, prof = profiled(train=True)
    raw = prof._tracker.stats
    assert raw[model.layers].calls == 0 and raw[model.layers].fwd_macs == 0
    eff = effective_stats(model, raw)
    layer_macs = 4 * 8 * 8
    assert eff[model.layers].fwd_macs == 3 * layer_macs
    assert eff[model.layers].fwd_flops == sum(raw[m].fwd_flops for m in model.layers)
    assert eff[model.layers].bwd_flops == sum(raw[m].bwd_flops for m in model.layers) > 0
    assert eff[model.layers].fwd_duration == sum(raw[m].fwd_duration for m in model.layers) > 0
    # called modules keep their own (inclusive) counters
    assert eff[model] is raw[model] and eff[model.out] is raw[model.out]
    prof.end_profile()


def test_printed_tree_shows_container_sum():
    model, prof = profiled()
    text = prof.model_profile_text(detailed=True)
    # "(layers): ModuleList(" then its profile line: params, % params, MACs, ...
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if "(layers): ModuleList(" in ln)
    assert re.search(r"768 MACs", lines[i + 1]), lines[i + 1]
    # aggregated view at depth 1 ranks the ModuleList by its children's MACs
    assert "'ModuleList': '768 MACs'" in text
    prof.end_profile()


def test_container_profiled_as_root_reports_children_latency():
    layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
    prof = FlopsProfiler(layers)
    prof.start_profile()
    x = torch.randn(2, 8)
    for layer in layers:
        x = layer(x)
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * (2 * 2 * 8 * 8)  # addmm's bias add is not counted
    assert prof.get_total_duration() > 0
    assert "fwd latency:" in prof.model_profile_text()
    prof.end_profile()
