"""The pipeline's training batch reads nothing back to the host (fp32, clipping on, printing off):
the gradient norm and the clip coefficient stay on the device (See [Note: scalars stay on the
device in the step]); only the first batch's shape handshake between stages reads its header."""

from __future__ import annotations

import torch
from torch import nn
from zero_core.testing import run_multirank
from zero_pipe import LayerSpec, PipelineEngine, PipelineModule

DIM, CLASSES, MB, MICRO_BATCHES = 8, 5, 4, 2


def _rank() -> list[tuple[int, list[str]]]:
    from zero_core import comm
    from zero_core.testing.host_syncs import count_host_syncs

    comm.set_device_check(True)
    specs = [LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, DIM, CLASSES)]
    model = PipelineModule(
        specs, num_stages=2, loss_fn=nn.CrossEntropyLoss(), seed_layers=True, partition_method="uniform"
    )
    cfg = {
        "train_batch_size": MB * MICRO_BATCHES,
        "train_micro_batch_size_per_gpu": MB,
        "gradient_clipping": 0.1,
        "steps_per_print": 10**6,
    }
    engine = PipelineEngine(model, torch.optim.AdamW(model.parameters(), lr=0.02), cfg)
    g = torch.Generator().manual_seed(3)
    batch = [
        (torch.randn(MB, DIM, generator=g), torch.randint(0, CLASSES, (MB,), generator=g)) for _ in range(2)
    ]
    out = []
    for _ in range(3):
        with count_host_syncs() as c:
            engine.train_batch(iter(batch))
        out.append((c.total, c.where))
    assert engine.get_global_grad_norm() > 0
    comm.set_device_check(False)
    return out


def test_pipeline_batches_have_no_host_syncs_after_the_handshake():
    for rank, counts in enumerate(run_multirank(_rank, 2, timeout=200)):
        first, *later = counts
        assert first[0] <= 2, (rank, first)  # the receiving stage reads the shape header once
        assert [n for n, _ in later] == [0, 0], (rank, later)
