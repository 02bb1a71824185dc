"""Test session setup: 8 fake CPU devices (for mesh tests) and float32 matmuls everywhere."""

import collections
import os
import shutil
import tempfile

# Before jax is imported: the CPU backend only (the test extra installs libtpu, with which JAX
# would try a TPU first: seconds more start-up and error lines on a CPU host; the topology
# compiles of tests/test_tpu_compile.py need no TPU backend), and libtpu loadable by every
# process (each xdist worker and subprocess that compiles for a topology loads it; without
# this the second fails on libtpu's lock file). Subprocesses inherit both.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The suite's programs are tiny and compiled once or twice each, so compiling is most of its
# time: LLVM's code generation at -O0 halves it (a third off the suite's wall time on 2 cores)
# for slower machine code. It changes how the CPU kernels round, not what they compute: every
# comparison in the suite is between two programs compiled this way (subprocesses inherit the
# flag), or to a tolerance against an independent computation. ``XLA_FLAGS`` that name a level
# keep theirs.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One persistent compilation cache for every training run of the session (the xdist workers,
# the subprocess runs and the notebook kernel inherit it): the many tiny runs share programs.
# A loaded program is the compiled one, so results are unchanged; train.compile_cache set by a
# test still wins.
# The session that made the directory removes it when it ends (``pytest_sessionfinish``).
_OWN_COMPILE_CACHE = None
if "RL_JAX_COMPILE_CACHE" not in os.environ:
  _OWN_COMPILE_CACHE = tempfile.mkdtemp(prefix="rl_jax_test_compile_cache_")
  os.environ["RL_JAX_COMPILE_CACHE"] = _OWN_COMPILE_CACHE

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# The same cache for the programs tests compile in-process (setups, steps and samplers built
# by hand, not through ``train.train``), caching every program as ``startup.use_compile_cache``
# does: the tiny setups of different tests share their init and sampler programs.
if os.environ["RL_JAX_COMPILE_CACHE"]:
  jax.config.update("jax_compilation_cache_dir", os.environ["RL_JAX_COMPILE_CACHE"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# ---------------------------------------------------------------- order of work under xdist
# With ``-n 2`` the two workers take whole files, longest first, each asking for the next
# file when it is free (longest-processing-time-first packing): a long file left to the end
# would keep one worker busy while the other idles, and a file split between workers would
# build its module-scoped training runs twice. The ranks are measured file times (each file
# run alone on 2 cores, ``--durations``: CPU seconds, 10 and more); files not listed follow
# in their usual order.
LONG_FILES_FIRST = [
    "test_multiprocess.py", "test_train.py", "test_train_objectives.py",
    "test_bench_scripts.py", "test_lora.py", "test_qlora.py", "test_train_async.py",
    "test_micro_batches.py", "test_memory.py", "test_agent_train.py", "test_moe_rl.py",
    "test_frozen_slices.py", "test_compile_options.py", "test_train_hf.py",
    "test_workdir_recovery.py", "test_serve_train.py", "test_fused_layers.py",
    "test_workdir_gcs.py", "test_agent_rollout.py", "test_paged_kv.py", "test_rollout.py",
    "test_models.py", "test_models_moe_gemma.py", "test_grouped.py", "test_notebook.py",
    "test_shared_prefix_attention.py", "test_env_import.py", "test_tpu_compile.py",
    "test_losses_compose.py", "test_sequence_parallel.py", "test_group_size.py",
    "test_moe_capacity.py", "test_serve.py", "test_agent_hf.py", "test_losses_objective.py",
    "test_offload.py", "test_api.py", "test_rollout_engine.py", "test_hf_streaming.py",
    "test_prefix_attention.py", "test_losses_vcpo.py", "test_moe_sharding.py",
    "test_sampler_copy.py",
    "test_profiling.py", "test_losses_formulas.py", "test_train_sharding.py", "test_optim.py",
    "test_epochs.py", "test_mismatch_corrections.py", "test_bench_scaling.py",
]


def pytest_sessionfinish(session, exitstatus):
  """Removes the session's compilation cache, in the process that made it (the xdist
  controller, after its workers are done; the workers inherited the directory)."""
  del session, exitstatus
  if _OWN_COMPILE_CACHE is not None:
    shutil.rmtree(_OWN_COMPILE_CACHE, ignore_errors=True)


# ------------------------------------------------------------------- the two test commands
# ``python -m pytest -q -n 2 tests`` (README) runs every test not marked ``slow``;
# ``python -m pytest -q -n 2 -m slow tests`` (CONTRIBUTING.md; CI runs both) the slow ones:
# end-to-end runs that repeat what a faster test checks on another path (a second process,
# a killed run, a bucket, the notebook). Any ``-m`` expression on the command line replaces
# this default (``-m "slow or not slow"``: everything).
SLOW_MARK = "slow"
# Tests marked slow here (a node id, or its start: every case of a parametrized test), with
# the faster test that covers the same code; ``@pytest.mark.slow`` on a test does the same.
SLOW_TESTS = (
    # runs killed or stopped and resumed; the resume path also runs in test_replay, test_lora
    "test_train.py::test_resume_after_sigkill_is_bit_exact",
    "test_train_async.py::test_fixed_lag_resume_after_sigkill_is_bit_exact",
    "test_agent_train.py::test_resume_with_held_trajectories_after_sigkill_is_bit_exact",
    "test_workdir_recovery.py::test_second_run_on_a_live_workdir_fails_in_one_line",
    "test_workdir_recovery.py::test_rerun_takes_over_the_lock_of_the_killed_run",
    "test_workdir_recovery.py::test_damaged_newest_checkpoint_is_skipped_and_kept",
    "test_workdir_recovery.py::test_resume_on_two_devices_matches_the_eight_device_run",
    "test_offload.py::test_offload_trains_identically_and_resumes_either_way",
    # other processes and places: two JAX processes, a bucket, the notebook's kernel, an
    # agent over HTTP (test_api, test_workdir_gcs's other tests, test_serve cover the parts)
    "test_multiprocess.py::test_two_processes_equal_one_and_resume",
    "test_multiprocess.py::test_killed_process_stops_the_other",
    "test_workdir_gcs.py::test_training_run_in_a_bucket_resumes_from_it",
    "test_notebook.py::test_quickstart_notebook_runs_and_shows_its_results",
    "test_serve_train.py::test_an_openai_agent_trains_through_sessions",
    "test_serve_train.py::test_sessions_sample_what_an_in_process_environment_samples",
    "test_xdist_crash.py::test_a_test_that_crashes_its_worker_once_runs_again_and_the_run_finishes",
    "test_xdist_crash.py::test_a_test_that_crashes_its_worker_twice_fails_and_the_run_finishes",
    "test_xdist_crash.py::test_a_test_that_hangs_is_stopped_with_its_stacks_and_fails",
    # a 64-chip slice's dry run in a subprocess (a libtpu abort would take pytest down)
    "test_tpu_compile.py::test_sampler_compiles_on_a_host_whose_chips_are_not_the_first_ids",
    # more TPU compiles of programs the fast suite compiles once: the largest-batch search
    # (two more batches of the quickstart's RL programs), a decode's weight gathers at 2 and
    # 4 layers of 64 MiB weights and its temporaries' growth from 2 to 4 layers
    # (test_decode_updates_each_layers_pool_in_place compiles the same decode at 2 layers
    # and checks that no layer's pool is copied), the decode's TPU lowering (compiled with
    # Mosaic by test_tpu_compile and test_qlora_decode)
    "test_tpu_compile.py::test_largest_batch_that_fits_is_compiled_and_the_next_is_not",
    "test_qlora_decode.py::test_bf16_decode_gathers_one_layer_at_a_time",
    "test_qlora_decode.py::test_the_decodes_temporaries_grow_by_less_than_a_quarter_pool_per_layer",
    "test_kernel_lowering.py::test_sampler_decode_program_lowers_with_the_paged_kernel[tpu]",
    # learning runs and whole-run equalities beside a faster case of the same code
    "test_train_async.py::test_quickstart_trains_asynchronously",
    "test_distill.py::test_distillation_trains_toward_the_teacher",
    "test_moe_rl.py::test_load_balancing_loss_term_of_the_updates",
    "test_replay.py::test_off_by_default_leaves_the_producer_state_as_it_was",
    "test_group_rewards.py::test_components_round_trip_through_the_checkpointed_queue",
    "test_memory.py::test_knob_baseline_learns",  # the quickstart's learning, with knobs
    "test_memory.py::test_memory_knob_still_learns",  # (test_rounding trains bf16 weights)
    "test_compile_options.py::"
    "test_training_programs_compile_with_the_cpu_options_to_the_same_values",
    "test_micro_batches.py::test_micro_batches_on_one_device_equal_the_eight_device_whole_batch",
    "test_micro_batches.py::test_micro_batched_update_equals_the_whole_minibatch[ppo]",
    "test_micro_batches.py::test_micro_batched_update_equals_the_whole_minibatch[lora]",
    "test_epochs.py::test_two_epochs_equal_a_hand_written_loop",
    # PPO's critic and VCPO's ESS end to end through train.train; the same presets' steps,
    # their vf_loss, value params and ess_ratio: test_train_objectives.py::
    # test_every_preset_and_advantage_trains[preset-ppo] and [preset-vcpo]
    "test_train.py::test_critic_and_off_policy_presets_train",
    "test_profiling.py::test_profile_step_writes_a_trace_and_its_summary",
    "test_bench_scaling.py::test_bench_scaling_small_reports_every_device_count",
    # the Tunix benchmark's rl_jax side with a long prompt (the served side runs the same)
    "test_bench_scripts.py::"
    "test_bench_tunix_prompt_tokens_sets_one_shared_prompt_and_the_rljax_side_runs_it",
    # model variants beside the dense case of the same test
    "test_frozen_slices.py::test_same_values_bit_for_bit[bf16]",
    "test_frozen_slices.py::test_same_values_bit_for_bit[int4]",
    "test_train_hf.py::test_gsm8k_config_with_hf_checkpoint[qwen3_moe]",
    "test_train_hf.py::test_gsm8k_config_with_hf_checkpoint[gemma3_text]",
    # the MoE sampler on 8 devices end to end; its expert layer at the decode's shape on
    # data x fsdp, forward and gradient: test_a_decode_batch_moves_its_tokens_to_the_experts
    "test_moe_sharding.py::test_moe_sampler_on_8_devices_equals_1",
    "test_frozen_slices.py::test_same_values_bit_for_bit[moe]",
    # the other case of the same parametrized test runs the same code
    "test_paged_kv.py::"
    "test_pages_of_any_size_and_a_preempting_pool_give_the_slot_layouts_tokens[0.0]",
    "test_sequence_parallel.py::test_sequence_split_matches_one_shard[2-packed]",
    "test_sequence_parallel.py::test_sequence_split_matches_one_shard[2-replicated]",
    # forks, a growing pool and a short budget on meshes; the fixed pool that preempts on
    # both meshes: test_paged_on_8_devices_equals_1, test_paged_on_a_sequence_mesh_equals_1
    "test_paged_kv.py::test_forks_growing_pools_and_short_budgets_on_meshes",
    "test_paged_kv.py::test_paged_on_a_sequence_mesh_equals_1",
    # cases of parametrized end-to-end checks whose other cases run the same code: the
    # micro-batched update (its grpo, ppo and lora cases stay), a prefix's forks (page sizes),
    # the own-pass update (its other objectives), the multi-turn fixed pool (lockstep case),
    # the GPU lowering of the decode (its TPU case; the TPU compile of the same program)
    "test_micro_batches.py::test_micro_batched_update_equals_the_whole_minibatch[dapo-entropy]",
    "test_micro_batches.py::test_micro_batched_update_equals_the_whole_minibatch[vcpo]",
    "test_micro_batches.py::"
    "test_micro_batched_update_equals_the_whole_minibatch[grpo-kl-offloaded-reference]",
    "test_paged_kv.py::test_samples_continuing_one_prefix_fork_it_and_sample_as_if_prefilled[2-48]",
    "test_on_policy.py::test_own_pass_update_equals_separate_pass_update[m2po]",
    "test_agent_rollout.py::test_a_fixed_pool_preempts_and_resumes_by_recompute[False]",
    "test_kernel_lowering.py::test_sampler_decode_program_lowers_with_the_paged_kernel[cuda]",
    # end-to-end runs whose parts have faster tests in the same file: the group-size
    # allocation (its allocation tests), an objective registered outside rl_jax (the
    # registry and every-preset tests), a supervised stage's checkpoints with KL (the rerun
    # and resume tests), a task file beside the config (the resolver and gymnasium tests),
    # the temporaries in blocks (the option's choice per device; the CPU options' values)
    "test_group_size.py::test_allocation_changes_without_recompiling",
    "test_train_objectives.py::test_estimator_registered_outside_rl_jax_trains_end_to_end",
    "test_train.py::test_kl_run_checkpoints_during_the_supervised_stage",
    "test_env_import.py::test_a_task_from_a_file_beside_the_config_trains",
    "test_compile_options.py::test_temp_blocks_split_the_temporaries_to_bit_identical_values",
    # the sequence-pool script end to end; its decode on a sequence axis, compiled for TPU:
    # test_paged_decode_over_a_sequence_axis_compiles_with_mosaic
    "test_tpu_compile.py::"
    "test_sequence_pool_script_splits_one_groups_pool_over_the_sequence_chips",
    "test_serve_train.py::"
    "test_a_failing_agent_fails_its_episodes_not_the_run[crashing_agent-agent_errors]",
    # engines and runs on a mesh beside a faster check of the same: the multi-turn engine on
    # 8 devices (test_agent_rollout.py::test_multi_turn_on_8_devices_equals_1), its TPU
    # programs (the one engine's prefill and decode: test_quickstart_compiles_for_v5e_...),
    # the rollout devices' copy (test_sampler_copy.py) beside the 8-device learner
    # (test_train.py::test_eight_devices_match_one), GiGPO's run (its advantages:
    # test_agent_train.py's other runs and the loss tests)
    "test_agent_train.py::test_agent_quickstart_episodes_on_8_devices_equal_1",
    "test_tpu_compile.py::test_multi_turn_run_compiles_the_agent_engines_programs",
    "test_train_async.py::test_split_rollout_and_training_meshes_match_one_device",
    "test_agent_train.py::test_agentic_gigpo_run_trains_and_writes_metrics",
    # the reductions option's values (its programs' make-up: test_xla_reductions_leave_...)
    "test_compile_options.py::test_training_programs_sum_in_xla_to_the_same_values",
    # benchmark scripts end to end at toy size (their parts have fast tests in the file)
    "test_bench_scripts.py::test_bench_update_runs_at_toy_size",
    "test_bench_scripts.py::"
    "test_bench_tunix_served_rljax_side_answers_sampler_calls_and_grpo_steps",
    "test_bench_scripts.py::test_bench_shared_prefix_quick_reports_both_layouts",
    "test_bench_scripts.py::test_bench_micro_batches_reports_each_k_at_toy_size",
    "test_bench_scripts.py::test_bench_trim_times_the_cut_the_whole_budget_and_packed_rows_at_toy_size",
    "test_bench_scripts.py::test_bench_rollout_april_section_runs_at_toy_size",
    "test_bench_scripts.py::test_accelerator_report_reduced_mode_on_cpu",
    # second cases of a parametrised check whose first case stays fast: int8 beside fp8
    # sampler weights, the MoE sampler copy beside the dense one, greedy beside sampled
    # preemption, Gemma 3's frozen slices beside the dense, int4 and MoE ones
    "test_sampler_weights.py::test_sampler_decodes_the_quantised_weights[int8]",
    # speculative continuations with the prompt on pages (resumed samples whose prompt is on
    # pages, as complete_prefixes gives them to the engine: test_rollout_engine.py::test_
    # april_returns_k_groups_and_resumes_exactly[True])
    "test_speculative.py::test_continuations_with_the_prompt_on_pages_draw_the_same_tokens",
    "test_sampler_copy.py::test_projections_in_the_compute_dtype_sample_the_same_tokens[moe]",
    "test_paged_kv.py::"
    "test_pages_of_any_size_and_a_preempting_pool_give_the_slot_layouts_tokens[0.0]",
    "test_frozen_slices.py::test_same_values_bit_for_bit[gemma3]",
    # the int4 decode on 8 devices (one device's int4 decode: test_decode_updates_each_
    # layers_pool_in_place; the paged decode on 8 devices: test_paged_kv.py), the multi-
    # turn pool growing with small pages (its fixed pool preempting: test_a_fixed_pool_
    # preempts_and_resumes_by_recompute[True]), multi-turn router replay's run (its records:
    # test_agent_rollout.py::test_multi_turn_records_the_experts_of_every_model_token,
    # test_moe_rl)
    "test_qlora_decode.py::test_int4_decode_on_8_devices_equals_1",
    "test_agent_rollout.py::test_small_pages_and_a_growing_pool_give_the_same_trajectories",
    "test_agent_train.py::test_router_replay_trains_a_multi_turn_moe_policy",
    # the learner's cut for a critic and for multi-turn trajectories (the Dr.GRPO case, with
    # its reference pass and the budget's constant, and GiGPO's uncut batch stay fast), the
    # tensor-parallel sampler's TPU collectives (its mesh, copy and plan: test_sampler_copy;
    # its training run: test_train.py::test_eight_devices_match_one), an int4 base's frozen
    # slices in the update (the dense case stays), the fused MLP of an MoE checkpoint's
    # dense layer (the dense and Gemma 3 cases stay), LoRA with asynchronous partial
    # rollouts (adapters-only training: test_lora_run_trains_adapters_only_...; partial
    # rollouts: test_train.py::test_partial_rollouts_...; the asynchronous trainer:
    # test_train_async.py), held multi-turn MoE groups' expert records (the records
    # themselves: test_multi_turn_records_the_experts_of_every_model_token), the MoE family's
    # shared-prefix layout (Gemma 3's sliding windows stay)
    "test_trim.py::test_update_on_the_cut_batch_equals_the_whole_budget[ppo]",
    "test_trim.py::test_update_on_the_cut_batch_equals_the_whole_budget[multi-turn]",
    "test_tpu_compile.py::test_a_tensor_parallel_sampler_gathers_a_fifth_of_the_bytes_on_tpu",
    "test_frozen_slices.py::test_no_whole_stack_copy_in_the_update[int4]",
    "test_fused_layers.py::test_fused_mlp_and_unrolled_layers_match_plain[qwen3_moe]",
    "test_lora.py::test_async_partial_rollouts_train_the_adapters_only_and_dry_run_plans_them",
    "test_agent_rollout.py::test_held_multi_turn_groups_keep_their_expert_records",
    "test_models_moe_gemma.py::test_shared_prefix_equals_replicated_and_forward[qwen3_moe]",
    # rows of several responses: PPO's critic and old-log-prob pass beside the KL reference
    # case, multi-turn trajectories (the segment rule they use: the same extent as
    # test_trim's cut), and the second architectures of the model-level checks (llama stays)
    "test_packing.py::test_the_update_on_rows_of_several_responses_equals_one_response_per_row"
    "[ppo]",
    "test_packing.py::test_multi_turn_trajectories_on_rows_of_several_equal_one_per_row",
    "test_packing.py::test_rows_of_several_responses_give_the_gradients_of_one_per_row[qwen3]",
    "test_packing.py::"
    "test_rows_of_several_responses_give_the_log_probs_and_entropies_of_one_per_row[qwen2]",
    # runs beside faster checks of their parts: QLoRA's run and export (the int4 base's
    # logits, gradients, merge and export: the rest of test_qlora.py), a run without the
    # supervised stage (its state: test_supervised_state_is_dropped_when_rl_starts), LoRA
    # checkpoints without a warm start (the LoRA run's checkpoints and resume), int8
    # rollouts with a correction (the int8 sampler: test_sampler_weights' decode test; the
    # corrections: the loss tests), the replay buffer's resume (its queue and draws; resume:
    # test_train.py), rows that cannot take several responses (the plan's rule beside it)
    "test_qlora.py::test_qlora_run_keeps_an_int4_base_and_exports_it",
    "test_memory.py::test_no_supervised_optimizer_state_with_sft_steps_zero",
    "test_lora.py::test_checkpoints_without_warm_start_hold_adapters_and_rebuild_the_base",
    "test_sampler_weights.py::test_int8_rollouts_train_with_an_is_correction",
    "test_replay.py::test_resume_is_bit_exact",
    "test_packing.py::test_the_plan_is_ignored_where_rows_cannot_take_several_responses",
    # second meshes and cases: the grouped layout's gradient on 8 devices (the packed rows'
    # 8-device twin: test_packing.py::test_rows_of_several_responses_on_eight_devices_...),
    # multi-turn teacher forcing at temperature 1 (0.7 stays), a growing pool for resumed
    # samples with prefixes of their own (shared prefixes stay)
    "test_grouped.py::test_packed_gradient_on_eight_devices_with_two_groups",
    "test_agent_rollout.py::"
    "test_logprobs_equal_teacher_forcing_and_observations_are_delta_ids[1.0]",
    "test_paged_kv.py::"
    "test_a_growing_pool_makes_room_for_long_resumed_samples_before_rebuilding_them[False]",
    # more cases and checks beside a faster one of the same code: LoRA on attention alone
    # (the fused MLP's own targets, gate,up and down, stay), llama's grouped gradient and
    # qwen2's grouped layout (qwen3's and llama's stay), an int4 base in the decode loop (the
    # dense case stays; int4 in the TPU decode: test_int4_values_are_gathered_per_layer_...),
    # the GPU split-K kernel at 3 splits and summing at 8 (2 splits and dot at 8 stay), the
    # int8 layer-wise merge (plain and int4 stay), the shared-prefix kernels' second shape
    # (the first and third stay), a fresh adapter's finite-difference gradient (adapters
    # against peft: test_adapters_match_peft_and_the_merged_export; gradients reaching the
    # adapters only: test_qlora.py), the MoE multi-turn run (its log-probs with the records
    # replayed, preempted and evicted: test_replaying_the_multi_turn_records_gives_the_
    # behaviour_logprobs), the benchmark scripts' kernel, packed-rows, speculative, decode
    # and sampling parts at toy size (the kernels: test_shared_prefix_attention.py, the
    # packed rows: test_grouped.py, speculative rollouts: test_speculative.py, the decode
    # attention: test_paged_kv.py's paged decode attention; the lockstep harness stays)
    "test_fused_layers.py::test_fused_mlp_with_lora_matches_unfused[q,v]",
    "test_grouped.py::test_packed_gradients_equal_replicated[llama]",
    "test_grouped.py::test_packed_equals_replicated_equals_plain[qwen2]",
    "test_frozen_slices.py::test_no_whole_stack_copy_in_the_decode_loop[int4]",
    "test_paged_attention.py::test_gpu_kernel_splits_a_row_over_programs[sum-3]",
    "test_paged_attention.py::test_gpu_kernel_splits_a_row_over_programs[dot-3]",
    "test_paged_attention.py::test_gpu_kernel_splits_a_row_over_programs[sum-8]",
    "test_qlora.py::test_layerwise_merge_equals_the_whole_stack_merge[int8]",
    "test_shared_prefix_attention.py::test_tpu_kernel_matches_plain_attention[shape1-",
    "test_shared_prefix_attention.py::test_gpu_kernel_matches_plain_attention[shape1-",
    "test_lora.py::"
    "test_fresh_adapters_leave_the_model_unchanged_and_gradients_match_finite_differences",
    "test_agent_rollout.py::test_a_mixture_of_experts_policy_runs_multi_turn",
    "test_bench_scripts.py::test_bench_shared_prefix_kernel_part_in_interpreter",
    "test_bench_scripts.py::test_bench_shared_prefix_packed_logprobs_equal_replicated",
    "test_bench_scripts.py::test_bench_speculative_reuses_every_draft_of_an_unchanged_policy",
    "test_bench_scripts.py::test_bench_decode_attention_baseline_is_the_same_attention_and_runs",
    "test_bench_scripts.py::test_bench_rollout_sampling_at_toy_size",
    # the sampler's greedy tokens against transformers for the other families (llama's
    # stays; every family's layers against transformers: test_models.py, the MoE forward:
    # test_models_moe_gemma's logits, its sampler against teacher forcing:
    # test_replaying_the_multi_turn_records_gives_the_behaviour_logprobs), the slot layout's
    # decode attention (one page of the paged decode attention, checked against float64
    # softmax by test_paged_decode_attention_reads_shuffled_and_in_place_pages_as_plain_...),
    # a preempting paged pool's log-probs against teacher forcing (its tokens and log-probs
    # are the slot layout's: test_pages_of_any_size_...[1.0]; the multi-turn fixed pool's
    # against teacher forcing: test_a_fixed_pool_preempts_and_resumes_by_recompute[True])
    "test_rollout.py::test_greedy_matches_transformers_generate[qwen2]",
    "test_rollout.py::test_greedy_matches_transformers_generate[qwen3]",
    "test_models_moe_gemma.py::test_greedy_generate_matches_transformers[qwen3_moe]",
    "test_rollout.py::test_decode_attention_with_length_last_keys_equals_plain_attention",
    "test_paged_kv.py::test_paged_logprobs_equal_teacher_forcing",
    # multi-turn: incremental prefill against re-prefill (the slot layout's case; pages of 8
    # read at a live bucket stay) and eviction by the time-to-live
    # (each turn's first token against one forward pass: the ``_check_exact`` tests;
    # evicted samples re-prefilled, with tools of random latency, give an uninterrupted
    # run's tokens: test_deterministic_decode_batches_do_not_depend_on_tool_timing[0]),
    # the multi-turn warm-up (the one loop's warm-up and its buckets: test_rollout_engine.py)
    "test_agent_rollout.py::test_incremental_prefill_equals_reprefill[None]",
    "test_agent_rollout.py::test_eviction_and_tool_timing_do_not_change_trajectories",
    "test_agent_rollout.py::test_warmup_compiles_every_shape_up_front",
    # further cases of parametrised checks whose other cases run the same code: page
    # bookkeeping on 2 slot shards of 1 sequence shard (1 x 1 and 2 x 2 stay), the GPU
    # kernel's dot path (its long pages and split rows: test_paged_attention's [dot-*]),
    # presets and a knob whose objective another fast run trains (GRPO: the quickstart's,
    # test_api's loop; Dr.GRPO: test_packing's and test_trim's [dr_grpo-kl]; decoupled PPO
    # and the entropy bonus: test_train_async.py), qwen3's packed log-probs (llama's stay;
    # qwen3's update on packed rows: test_packing's [dr_grpo-kl]), fsdp_tp's forward on 8
    # devices (its gradient on that mesh: test_gradients_8_devices_equal_1; its forward with
    # a data axis stays), two row-sharded losses (vcpo and ppo stay), a second set of ragged
    # lengths, int8 beside int4 quantised on load, a second capacity of the dropped
    # assignments
    "test_paged_kv.py::test_page_bookkeeping_matches_python_reference_counts[2-1]",
    "test_paged_attention.py::test_gpu_kernel_dot_path_matches_reference",
    "test_train_objectives.py::test_every_preset_and_advantage_trains[preset-grpo]",
    "test_train_objectives.py::test_every_preset_and_advantage_trains[preset-dr_grpo]",
    "test_train_objectives.py::test_every_preset_and_advantage_trains[preset-decoupled_ppo]",
    "test_train_objectives.py::test_every_preset_and_advantage_trains[knob-entropy_coef=0.01]",
    "test_packing.py::"
    "test_rows_of_several_responses_give_the_log_probs_and_entropies_of_one_per_row[qwen3]",
    "test_sharding.py::test_forward_8_devices_equals_1[fsdp_tp-shape1]",
    "test_losses_compose.py::test_eight_devices_equal_one[grpo]",
    "test_losses_compose.py::test_eight_devices_equal_one[gspo]",
    "test_prefix_attention.py::test_concat_attention_matches_reference[lengths1]",
    "test_hf_streaming.py::test_quantised_load_equals_whole_base_quantisation[int8-16]",
    "test_moe_capacity.py::test_dropped_assignments_and_output_match_numpy[1.0-shape1-fsdp]",
    # a user's group function end to end (loading it by import path and checking it:
    # test_bad_group_fns_fail_in_one_line; group scores in the producer:
    # test_majority_vote_trains_on_sorting), finite differences of gradients that autodiff
    # of the unfused MLP checks (the adapters': test_fused_mlp_with_lora_matches_unfused;
    # SwiGLU's backward: test_swiglu_mlp_matches_autodiff), the reference attention at
    # random shapes (three fixed shapes stay), the command's line for an unknown topology
    # (the parse error: test_unknown_topology_is_one_line; the command's one error line:
    # test_train.py::test_bad_config_command_fails_in_one_line)
    "test_group_rewards.py::test_user_group_fn_by_import_path_trains_and_reaches_the_metrics",
    "test_fused_layers.py::test_fused_mlp_adapter_gradient_matches_finite_differences",
    "test_fused_layers.py::test_swiglu_mlp_gradient_matches_finite_differences",
    "test_shared_prefix_attention.py::test_reference_matches_plain_attention_random_shapes",
    "test_tpu_compile.py::test_cli_prints_one_error_line_for_an_unknown_topology",
    # the FSDP update's FLOPs on 4 TPU chips against a 1-chip compile (its FLOPs split on 8
    # devices: test_moe_sharding.py::test_moe_rl_update_on_8_devices_equals_1; its gather and
    # reduce-scatter on 4 chips: test_quickstart_compiles_for_v5e_with_the_mosaic_kernel)
    "test_tpu_compile.py::test_fsdp_update_flops_split_over_four_chips_with_a_reduce_scatter",
)


def _is_slow(item) -> bool:
  nodeid = item.nodeid.split("/")[-1]  # "test_x.py::test_y[case]"
  return bool(item.get_closest_marker(SLOW_MARK)) or nodeid.startswith(SLOW_TESTS)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", f"{SLOW_MARK}: a long end-to-end test, run by `pytest -m {SLOW_MARK}` (CI runs "
      "both commands)")


def pytest_collection_modifyitems(config, items):
  """Without ``-m``, deselects the tests marked ``slow``; then puts the files of
  ``LONG_FILES_FIRST`` first, in that order (a stable sort: the tests of a file keep their
  order)."""
  for item in items:
    if _is_slow(item) and not item.get_closest_marker(SLOW_MARK):
      item.add_marker(SLOW_MARK)
  if not config.getoption("markexpr"):
    slow = [item for item in items if item.get_closest_marker(SLOW_MARK)]
    if slow:
      config.hook.pytest_deselected(items=slow)
      items[:] = [item for item in items if not item.get_closest_marker(SLOW_MARK)]
  rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


CRASH_RERUNS = 1  # how often a test that killed its worker runs again before it fails


def pytest_xdist_make_scheduler(config, log):
  """Whole files to each worker, in collection order (see ``LONG_FILES_FIRST``), unless the
  command line chose another ``--dist`` than the default ``load``."""
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=import-outside-toplevel

  class FileScheduling(LoadFileScheduling):
    """``LoadFileScheduling`` whose crashed worker does not hang the run.

    xdist's own ``remove_node`` puts every file the dead worker had back on the queue, the
    finished ones too: a replacement worker handed a finished file gets no test to run, never
    asks for more, and the session waits forever. Here only unfinished files go back. The
    test that was running when the worker died goes back with its file once (a fault inside
    XLA's CPU compiler has killed a worker about once in four full runs, never twice on one
    test); a second crash of the same test fails it.
    """

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.crashes = collections.Counter()

    def remove_node(self, node):
      workload = self.assigned_work.pop(node)
      unfinished = [(name, unit) for name, unit in workload.items() if not all(unit.values())]
      if not unfinished:
        return None
      crashed_unit = unfinished[0][1]  # a worker runs its files and their tests in order
      crashitem = next(nodeid for nodeid, done in crashed_unit.items() if not done)
      self.crashes[crashitem] += 1
      crashed_unit[crashitem] = self.crashes[crashitem] > CRASH_RERUNS
      for name, unit in unfinished:
        if not all(unit.values()):
          self.workqueue[name] = unit
      for other in self.assigned_work:
        self._reschedule(other)
      return crashitem

  config.option.loadscopereorder = False  # keep the longest-first order
  return FileScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  """A crashed test that ``FileScheduling`` runs again is reported as "rerun", not failed,
  with one line naming it; its second run's outcome is the test's."""
  crashes = getattr(sched, "crashes", {})
  if 0 < crashes.get(crashitem, 0) <= CRASH_RERUNS:
    report.outcome = "rerun"
    reporter = sched.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
      reporter.write_line(f"{report.longrepr}; running it again on a new worker")


def pytest_report_teststatus(report):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None
