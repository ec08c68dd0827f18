# ruff: noqa: E501  (test ids are as long as the tests name them)
"""The extended tier: tests the README's ``pytest`` runs and CI's 40-minute run leaves out (``-m "not extended"``).

CI has two cores and 40 minutes; the whole suite takes about an hour there. A test is in this tier only when CI runs
every check it makes on another path: the same run through the other engine, the same mechanism at fewer steps, or
a learning run that another learning run and the unit tests of its one difference cover. Each entry names those
CI tests (``tests/FILE.py::NAME``), and ``tests/test_ci_tiers.py`` holds each name to a test that exists and is
not extended itself. Run the tier with ``pytest -m extended`` (and the engines' venvs for their entries) before a
change that touches what an entry exercises.
"""

#: test id (``tests/FILE.py::NAME``, or ``...::NAME[PARAM]`` for one case) -> the CI tests that cover it, and how
EXTENDED: dict[str, str] = {
    "tests/test_engine_e2e.py::test_reward_rises_with_engine_killed_and_restarted[sglang-16]":
        "tests/test_engine_e2e.py::test_reward_rises_with_engine_killed_and_restarted, cut to 5 steps on each engine "
        "(the kill and restart, full batches, the engine's log-probs against the trainer's at every step, the "
        "evaluations), and tests/test_trainer_e2e.py::test_reward_rises (the rise over 16 steps, embedded engine)",
    "tests/test_engine_e2e.py::test_async_rollout_with_engine_stays_within_the_staleness_bound[vllm]":
        "tests/test_engine_e2e.py::test_async_rollout_with_engine_stays_within_the_staleness_bound on SGLang, and "
        "tests/test_async_rollout.py::test_partial_rollout_continues_a_generation_across_a_weight_sync_keeping_the_tokens_before_and_after "
        "on vLLM (its abort across a sync)",
    "tests/test_async_rollout.py::test_partial_rollout_continues_a_generation_across_a_weight_sync_keeping_the_tokens_before_and_after[sglang]":
        "the same test on vLLM and the embedded engine, and "
        "tests/test_sglang_abort.py::test_engine_abort_keeps_the_tokens_so_far (SGLang's abort keeps every token)",
    "tests/test_async_rollout.py::test_async_run_with_the_decoupled_loss_at_staleness_4_learns_the_quickstart_task":
        "tests/test_async_rollout.py::test_async_run_learns_the_quickstart_task (the async run learns), "
        "tests/test_async_rollout.py::test_async_resume_sees_the_prompts_an_uninterrupted_run_saw (staleness 2), and "
        "tests/test_decoupled_loss.py::test_the_decoupled_loss_clips_around_the_proximal_policy_and_weighs_by_prox_over_behav "
        "with tests/test_decoupled_loss.py::test_the_flags_reach_the_workers_loss_configuration (the loss itself)",
    "tests/test_engine_families.py::test_a_moe_family_trains_and_syncs_through_the_engine[sglang-mixtral]":
        "tests/test_engine_families.py::test_a_moe_family_trains_and_syncs_through_the_engine on Qwen3-MoE (SGLang's "
        "fused experts through the trainer's sync), and "
        "tests/test_family_loop.py::test_every_family_trains_end_to_end_and_the_engine_holds_the_trained_weights "
        "(Mixtral's whole loop)",
    "tests/test_weight_sync.py::test_tensor_transport_packs_in_the_trainer_and_sglang_loads_the_bytes_untouched[tp1]":
        "the same test at TP 2 (the same packing, a payload per TP rank), and "
        "tests/test_sglang_backend.py::test_tensor_transport_takes_a_bucket_packed_in_this_process (one payload)",
    "tests/test_vision_engines.py::test_vllm_serves_a_vision_language_policy_through_the_trainer":
        "tests/test_vision_trainer.py::test_a_vision_language_policy_trains_and_the_engine_holds_its_weights (the "
        "trainer's loop with images), tests/test_vision_engines.py::test_vllm_log_probs_of_image_rows_equal_the_trainers "
        "and tests/test_vision_engines.py::test_vllm_takes_a_changed_vision_tower_through_a_sync (vLLM's image rows "
        "and their weights' sync)",
    "tests/test_lora_engines.py::test_vllm_serves_the_peft_model_after_a_merged_lora_sync":
        "tests/test_lora_engines.py::test_sglang_serves_the_peft_model_after_a_merged_lora_sync (the same merged sync), "
        "tests/test_lora_engines.py::test_vllm_serves_each_synced_adapter_version_under_a_fresh_lora_id (vLLM serving "
        "the PEFT model), and tests/test_vllm_backend.py::test_zero3_trainer_round_trip_into_a_vllm_engine_actor "
        "(a full sync into vLLM)",
}
