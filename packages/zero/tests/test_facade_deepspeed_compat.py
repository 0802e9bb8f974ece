"""The facade exports the DeepSpeed drop-in names of zero-core (issue 26's engine/ZeRO-3 part)."""

from __future__ import annotations

import copy


def test_facade_exports():
    import zero

    for name in ("OnDevice", "MiCS_Init", "unwrap_model_for_generation", "initialize"):
        assert callable(getattr(zero, name))
    for name in (
        "safe_set_full_grad",
        "safe_set_local_grad",
        "set_z3_leaf_modules",
        "unset_z3_leaf_modules",
        "get_z3_leaf_modules",
        "z3_leaf_module",
        "set_random_seed",
    ):
        assert callable(getattr(zero.utils, name)), name
    assert zero.zero.OnDevice is zero.OnDevice and zero.zero.MiCS_Init is zero.MiCS_Init
    assert callable(zero.checkpointing.non_reentrant_checkpoint)
    assert copy.copy(zero.utils.set_random_seed) is zero.utils.set_random_seed


def test_facade_exports_the_deepspeed_checkpoint_importer():
    import zero
    import zero_core.checkpoint

    assert zero.checkpoint.from_deepspeed is zero_core.checkpoint.from_deepspeed


def test_progressive_layer_drop_module():
    # deepspeed.runtime.progressive_layer_drop.ProgressiveLayerDrop -> zero.progressive_layer_drop
    import zero.progressive_layer_drop as pld
    from zero_core.engine.progressive_layer_drop import ProgressiveLayerDrop

    assert pld.ProgressiveLayerDrop is ProgressiveLayerDrop
    schedule = pld.ProgressiveLayerDrop(theta=0.5, gamma=0.1)
    schedule.update_state(0)
    assert schedule.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
