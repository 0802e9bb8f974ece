"""The config keys zero implements, each with the test that shows its effect.

Category (a) of [Note: config key truth] (``key_paths.py``): a dotted key -> ``"test file::test
name"`` (the file relative to the repository root). ``test_config_truth.py`` parses every named
file and fails on a test that does not exist, on a config field in none or in two of
``EFFECT_TESTS`` / ``unimplemented.UNIMPLEMENTED`` / ``no_effect.NO_EFFECT``, and on an entry
naming no field. The test named must show the key's effect: the run differs, or a measured
quantity changes, when the key is set. One entry per line; when a feature lands, move its key
here from ``UNIMPLEMENTED``.
"""

from __future__ import annotations

_CORE = "packages/zero-core/tests/"
_KEYS = _CORE + "test_config_key_effects.py::"
_FP16 = _CORE + "test_engine_fp16.py::test_overflow_on_one_rank_skips_everywhere_and_follows_hysteresis"
_AC = _CORE + "test_activation_checkpointing.py::"
_MON = _CORE + "test_monitors.py::"
_LOG = _CORE + "test_comm_logger.py::"
_TUNE = "packages/zero-profiler/tests/"  # the autotuner is zero-profiler's (zero_profiler.autotuning)
_AT = _TUNE + "test_autotuning_section_keys.py::"
_OFF = "packages/zero-offload/tests/"
_PROF = "packages/zero-profiler/tests/test_profiler_engine_hook.py::test_profiles_only_the_configured_step"
_AIO = "packages/zero-ops/tests/test_ops_aio.py::"
_MICS = _CORE + "test_stage3_mics_hpz.py::test_cross_node_bytes_per_step_match_the_formulas"
_ZPP = _CORE + "test_stage3_zeropp_quantized.py::test_bytes_per_step_match_the_formulas"

#: dotted config key -> "test file::test name" showing its effect.
EFFECT_TESTS: dict[str, str] = {
    # -- top level ------------------------------------------------------------------------------
    "train_batch_size": _CORE + "test_config_batch.py::test_derivation",
    "train_micro_batch_size_per_gpu": _CORE
    + "test_engine_dataloader.py::test_sharded_reshuffled_collated_loader",
    "gradient_accumulation_steps": _CORE + "test_engine_stage0.py::test_stage0_matches_single_process",
    "steps_per_print": _KEYS + "test_steps_per_print_and_wall_clock_breakdown_shape_the_progress_line",
    "wall_clock_breakdown": _KEYS + "test_steps_per_print_and_wall_clock_breakdown_shape_the_progress_line",
    "dump_state": _KEYS + "test_dump_state_prints_the_engine_state_once",
    "memory_breakdown": _KEYS + "test_memory_breakdown_and_throughput_switch_change_the_progress_line",
    "gradient_clipping": _CORE + "test_engine_stage0.py::test_stage0_matches_single_process",
    "prescale_gradients": _CORE + "test_prescale_gradients.py::test_fp16_shows_the_division_before_the_sum",
    "gradient_predivide_factor": _CORE
    + "test_prescale_gradients.py::test_fp16_shows_the_division_before_the_sum",
    "sparse_gradients": _CORE
    + "test_sparse_gradients.py::test_sparse_reduction_equals_dense_and_sends_fewer_bytes",
    "communication_data_type": _CORE
    + "test_stage3_comm_dtype.py::test_reduce_scatter_uses_communication_data_type",
    "comms_timeout": _KEYS + "test_comms_timeout_bounds_every_collective",
    "zero_allow_unknown_keys": _CORE + "test_config_errors.py::test_unknown_keys_downgraded_by_config_switch",
    "dataloader_drop_last": _CORE + "test_engine_dataloader.py::test_sharded_reshuffled_collated_loader",
    # -- fp16, bf16, data types -----------------------------------------------------------------
    "fp16.enabled": _CORE + "test_engine_fp16.py::test_static_loss_scale",
    "fp16.auto_cast": _CORE + "test_engine_auto_cast.py::test_auto_cast_feeds_fp32_inputs_to_an_fp16_model",
    "fp16.loss_scale": _CORE + "test_engine_fp16.py::test_static_loss_scale",
    "fp16.initial_scale_power": _FP16,
    "fp16.loss_scale_window": _FP16,
    "fp16.hysteresis": _FP16,
    "fp16.consecutive_hysteresis": _FP16,
    "fp16.min_loss_scale": _FP16,
    "bf16.enabled": _CORE + "test_engine_bf16.py::test_bf16_matches_hand_written_mixed_precision",
    "bf16.check_grad_overflow": _CORE
    + "test_engine_bf16.py::test_bf16_skips_a_step_with_non_finite_gradients",
    "data_types.grad_accum_dtype": (
        _CORE
        + "test_grad_accum_dtype.py::test_fp32_accumulation_is_the_exact_fp32_sum_of_the_bf16_micro_gradients"
    ),
    # -- optimizer, scheduler -------------------------------------------------------------------
    "optimizer.type": _CORE + "test_optim_builder.py::test_builds_each_config_type",
    "optimizer.params": _CORE + "test_optim_builder.py::test_builds_each_config_type",
    "scheduler.type": _CORE + "test_lr_schedules.py::test_build_from_config_matches_direct_construction",
    "scheduler.params": _CORE + "test_lr_schedules.py::test_build_from_config_matches_direct_construction",
    # -- zero_optimization ----------------------------------------------------------------------
    "bf16.bf16_master_weights_and_grads": _CORE
    + "test_bf16_master_mode.py::test_bf16_masters_train_exactly_like_a_torch_bf16_model",
    "bf16.bf16_optimizer_states": _CORE + "test_bf16_master_mode.py::test_memory_breakdown_shows_the_formula",
    "zero_optimization.module_granularity_threshold": _CORE
    + "test_stage3_module_granularity.py::test_threshold_fetches_blocks_whole_and_trains_like_torch",
    "zero_optimization.use_all_reduce_for_fetch_params": _CORE
    + "test_stage3_allreduce_fetch.py::test_all_reduce_fetch_trains_like_torch_and_like_the_all_gather",
    "progressive_layer_drop.enabled": _CORE
    + "test_engine_progressive_layer_drop.py::test_engine_passes_the_schedule_and_trains_as_plain_pytorch",
    "progressive_layer_drop.theta": _CORE
    + "test_engine_progressive_layer_drop.py::test_schedule_is_deepspeeds_to_the_bit",
    "progressive_layer_drop.gamma": _CORE
    + "test_engine_progressive_layer_drop.py::test_schedule_is_deepspeeds_to_the_bit",
    "zero_optimization.stage": _CORE
    + "test_stage12_memory_comm.py::test_stage12_memory_and_comm_volume_match_theory",
    "zero_optimization.contiguous_gradients": _KEYS
    + "test_contiguous_gradients_frees_each_gradient_in_its_hook",
    "zero_optimization.reduce_scatter": _KEYS + "test_stage12_knobs_change_the_collectives",
    "zero_optimization.reduce_bucket_size": _KEYS + "test_stage12_knobs_change_the_collectives",
    "zero_optimization.use_multi_rank_bucket_allreduce": _KEYS + "test_stage12_knobs_change_the_collectives",
    "zero_optimization.allgather_partitions": _KEYS + "test_stage12_knobs_change_the_collectives",
    "zero_optimization.allgather_bucket_size": _KEYS + "test_stage12_knobs_change_the_collectives",
    "zero_optimization.overlap_comm": _KEYS + "test_overlap_comm_launches_reductions_during_backward",
    "zero_optimization.load_from_fp32_weights": (
        _KEYS + "test_load_from_fp32_weights_false_builds_masters_from_the_16bit_weights"
    ),
    "zero_optimization.offload_param.device": _OFF
    + "test_offload_param.py::test_offload_param_matches_single_process_torch",
    "zero_optimization.offload_param.nvme_path": (
        _OFF + "test_offload_memory_faults.py::test_offload_nvme_unwritable_path_fails_at_initialize"
    ),
    "zero_optimization.offload_param.buffer_count": _OFF
    + "test_offload_param.py::test_offload_param_clear_errors",
    "zero_optimization.offload_param.pin_memory": _OFF
    + "test_offload_copies.py::test_offload_copies_are_pinned_non_blocking_and_fenced",
    "zero_optimization.offload_param.buffer_size": _OFF
    + "test_offload_param.py::test_offload_param_clear_errors",
    "zero_optimization.offload_param.max_in_cpu": _OFF
    + "test_offload_param.py::test_offload_param_matches_single_process_torch",
    "zero_optimization.offload_optimizer.device": (
        _OFF + "test_offload_memory_faults.py::test_offload_memory_device_side_is_params_and_grads"
    ),
    "zero_optimization.offload_optimizer.nvme_path": (
        _OFF + "test_offload_memory_faults.py::test_offload_nvme_unwritable_path_fails_at_initialize"
    ),
    "zero_optimization.offload_optimizer.buffer_count": (
        _OFF + "test_offload_memory_faults.py::test_offload_nvme_buffer_count_too_small_for_pipeline"
    ),
    "zero_optimization.offload_optimizer.pin_memory": (
        _OFF + "test_offload_copies.py::test_offload_copies_are_pinned_non_blocking_and_fenced"
    ),
    "zero_optimization.offload_optimizer.pipeline_read": (
        _OFF + "test_offload_memory_faults.py::test_offload_nvme_buffer_count_too_small_for_pipeline"
    ),
    "zero_optimization.offload_optimizer.pipeline_write": (
        _OFF + "test_offload_memory_faults.py::test_offload_nvme_buffer_count_too_small_for_pipeline"
    ),
    "zero_optimization.offload_optimizer.fast_init": _OFF
    + "test_offload_fast_init.py::test_fast_init_skips_the_zero_writes",
    "zero_optimization.offload_optimizer.ratio": _OFF
    + "test_offload_parity.py::test_offload_matches_single_process_torch",
    "zero_optimization.sub_group_size": (
        _OFF + "test_offload_memory_faults.py::test_offload_memory_device_side_is_params_and_grads"
    ),
    "zero_optimization.prefetch_bucket_size": _CORE + "test_stage3_api.py::test_memory_and_comm_volume",
    "zero_optimization.param_persistence_threshold": _CORE
    + "test_stage3_api.py::test_memory_and_comm_volume",
    "zero_optimization.model_persistence_threshold": (
        _KEYS + "test_model_persistence_threshold_caps_the_persistent_parameters"
    ),
    "zero_optimization.max_live_parameters": _CORE + "test_stage3_api.py::test_memory_and_comm_volume",
    "zero_optimization.max_reuse_distance": _CORE + "test_stage3_api.py::test_memory_and_comm_volume",
    "zero_optimization.gather_16bit_weights_on_model_save": _CORE
    + "test_stage3_hf_models.py::test_hf_model_under_stage3",
    "zero_optimization.ignore_unused_parameters": (
        _CORE + "test_stage12_unused_frozen.py::test_stage12_unused_and_frozen_parameters"
    ),
    "zero_optimization.zero_hpz_partition_size": _MICS,
    "zero_optimization.zero_quantized_weights": _ZPP,
    "zero_optimization.zero_quantized_nontrainable_weights": (
        _CORE + "test_stage3_zeropp_quantized.py::test_zero_init_and_frozen_weights_stored_quantized"
    ),
    "zero_optimization.zero_quantized_gradients": _ZPP,
    "zero_optimization.mics_shard_size": _MICS,
    "zero_optimization.mics_hierarchical_params_gather": _MICS,
    # -- activation checkpointing ---------------------------------------------------------------
    "activation_checkpointing.partition_activations": _AC + "test_partition_activations_two_ranks",
    "activation_checkpointing.contiguous_memory_optimization": _AC
    + "test_contiguous_buffers_profile_and_reset",
    "activation_checkpointing.cpu_checkpointing": _AC + "test_checkpoint_in_cpu_keeps_a_separate_copy",
    "activation_checkpointing.number_checkpoints": _AC + "test_contiguous_buffers_profile_and_reset",
    "activation_checkpointing.synchronize_checkpoint_boundary": (
        _KEYS + "test_synchronize_checkpoint_boundary_synchronizes_around_each_checkpoint"
    ),
    "activation_checkpointing.profile": _AC + "test_contiguous_buffers_profile_and_reset",
    # -- monitors, comms logger, checkpoint -----------------------------------------------------
    "tensorboard.enabled": _MON + "test_master_fans_out_to_every_enabled_monitor",
    "tensorboard.output_path": _MON + "test_tensorboard_event_file_has_the_scalars",
    "tensorboard.job_name": _MON + "test_tensorboard_event_file_has_the_scalars",
    "wandb.enabled": _CORE + "test_engine_monitors.py::test_engine_writes_tensorboard_csv_and_wandb",
    "wandb.group": _MON + "test_wandb_defaults_to_offline_and_writes_a_local_run",
    "wandb.team": _MON + "test_wandb_defaults_to_offline_and_writes_a_local_run",
    "wandb.project": _MON + "test_wandb_defaults_to_offline_and_writes_a_local_run",
    "csv_monitor.enabled": _MON + "test_master_fans_out_to_every_enabled_monitor",
    "csv_monitor.output_path": _MON + "test_csv_one_file_per_metric_flushed_and_resumable",
    "csv_monitor.job_name": _MON + "test_csv_one_file_per_metric_flushed_and_resumable",
    "comms_logger.enabled": _CORE + "test_init_distributed.py::test_config_comms_logger_section_is_applied",
    "comms_logger.verbose": _LOG + "test_verbose_debug_and_log_summary",
    "comms_logger.prof_all": _LOG + "test_configure_from_config_section",
    "comms_logger.debug": _LOG + "test_verbose_debug_and_log_summary",
    "comms_logger.prof_ops": _LOG + "test_prof_ops_filter_and_async_timing",
    "checkpoint.tag_validation": _CORE
    + "test_deepspeed_compat_config.py::test_checkpoint_tag_validation_modes",
    # -- plugin sections: pipeline (zero-pipe), aio (zero-offload/zero-ops), flops_profiler ------
    "pipeline.stages": "packages/zero-pipe/tests/test_pipe_initialize.py::test_initialize_builds_pipeline_engine_from_config",
    "pipeline.activation_checkpoint_interval": (
        "packages/zero-pipe/tests/test_pipe_initialize.py::test_initialize_builds_pipeline_engine_from_config"
    ),
    "pipeline.lookahead": "packages/zero-pipe/tests/test_pipe_schedule.py::test_lookahead_hides_message_latency",
    "aio.block_size": _AIO + "test_round_trip_odd_sizes_and_offsets",
    "aio.queue_depth": _AIO + "test_o_direct_used_for_aligned_buffers",
    "aio.thread_count": "packages/zero-ops/tests/test_ops_aio_runs.py::test_runs_of_concurrent_requests_stay_separate",
    "aio.single_submit": _AIO + "test_round_trip_odd_sizes_and_offsets",
    "aio.overlap_events": _AIO + "test_round_trip_odd_sizes_and_offsets",
    "flops_profiler.enabled": "packages/zero-profiler/tests/test_profiler_engine_hook.py::test_disabled_does_nothing",
    "flops_profiler.recompute_fwd_factor": (
        "packages/zero-profiler/tests/test_profiler_flops.py::test_estimate_without_backward_uses_recompute_factor"
    ),
    "flops_profiler.profile_step": _PROF,
    "flops_profiler.module_depth": _PROF,
    "flops_profiler.top_modules": _PROF,
    "flops_profiler.detailed": _PROF,
    "flops_profiler.output_file": _PROF,
    # -- autotuning (zero run --autotuning) -----------------------------------------------------
    "autotuning.enabled": _TUNE + "test_autotuning.py::test_engine_hook_only_for_experiments",
    "autotuning.fast": _TUNE + "test_autotuning.py::test_space_from_auto_lists_and_fixed_values",
    "autotuning.results_dir": _AT + "test_model_info_comes_from_the_configured_places",
    "autotuning.exps_dir": _AT + "test_finished_experiments_are_reused_from_exps_dir_unless_overwrite",
    "autotuning.overwrite": _AT + "test_finished_experiments_are_reused_from_exps_dir_unless_overwrite",
    "autotuning.metric": _TUNE + "test_autotuning.py::test_search_measures_the_model_and_confirms_the_pick",
    "autotuning.start_profile_step": _TUNE
    + "test_autotuning_confirm.py::test_engine_metric_is_the_median_step",
    "autotuning.end_profile_step": _TUNE
    + "test_autotuning_confirm.py::test_engine_metric_is_the_median_step",
    "autotuning.metric_path": _TUNE + "test_autotuning_confirm.py::test_engine_metric_is_the_median_step",
    "autotuning.tuner_type": _TUNE
    + "test_autotuning.py::test_search_measures_the_model_and_confirms_the_pick",
    "autotuning.tuner_early_stopping": _AT + "test_search_limits_follow_the_section",
    "autotuning.tuner_num_trials": _AT + "test_search_limits_follow_the_section",
    "autotuning.arg_mappings": _AT + "test_arg_mappings_set_the_script_flags",
    "autotuning.max_train_batch_size": _AT + "test_search_limits_follow_the_section",
    "autotuning.min_train_batch_size": _AT + "test_search_limits_follow_the_section",
    "autotuning.max_train_micro_batch_size_per_gpu": _AT + "test_search_limits_follow_the_section",
    "autotuning.min_train_micro_batch_size_per_gpu": _AT + "test_search_limits_follow_the_section",
    "autotuning.num_tuning_micro_batch_sizes": _AT + "test_search_limits_follow_the_section",
    "autotuning.mp_size": _AT + "test_mp_size_and_memory_budget_decide_what_is_tried",
    "autotuning.model_info": _TUNE + "test_autotuning.py::test_memory_pruning_launches_only_stage_3",
    "autotuning.model_info_path": _AT + "test_model_info_comes_from_the_configured_places",
    "autotuning.memory_budget": _AT + "test_mp_size_and_memory_budget_decide_what_is_tried",
    "autotuning.experiment_timeout": _TUNE
    + "test_autotuning.py::test_failures_are_recorded_and_a_killed_search_resumes",
    "autotuning.confirm_top_k": _TUNE + "test_autotuning_confirm.py::test_confirm_top_k_limits_the_phase",
    # -- timers ----------------------------------------------------------------------------------
    "timers.throughput.enabled": _KEYS
    + "test_memory_breakdown_and_throughput_switch_change_the_progress_line",
}
