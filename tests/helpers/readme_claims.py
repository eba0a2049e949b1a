"""Each claim of README.md's opening and of its "What you can do" list, and the tests that prove it.

A claim is (the bullet's bold heading, or "opening" / "quick start"; a piece of the README's text,
whitespace aside; the test node ids that fail without it). tests/project/test_readme.py checks that every
bullet has claims, that every piece is in the README and that every test exists. A sentence added
to the list needs a row here; a claim no test proves is qualified or removed instead.
"""

from __future__ import annotations

CLAIMS: list[tuple[str, str, tuple[str, ...]]] = [
    # The opening
    (
        "opening",
        "Greedy output is then reproducible (the same alone or in a crowded step, after a "
        "prefix-cache hit, after a restart)",
        ("tests/project/test_readme.py::test_greedy_output_with_the_defaults_is_reproducible",),
    ),
    (
        "opening",
        "close to transformers' (on a fixed text, top-1 agreement 91-92 %",
        (
            "tests/test_engine.py::test_default_model_with_int8_block_activations_is_still_the_model",
            "tests/test_engine.py::test_default_model_in_bfloat16_predicts_what_transformers_does",
        ),
    ),
    (
        "opening",
        "whose greedy output equals transformers' float32 token for token, under `--tp 2` too",
        (
            "tests/test_engine.py::test_default_model_matches_transformers",
            "tests/server/test_server_lifecycle.py::test_tp2_equals_tp1_with_deterministic",
            "tests/project/test_readme.py::test_deterministic_is_float32_on_float_activations_and_refuses_the_rest",
        ),
    ),
    (
        "opening",
        "the GPU paths are tested only on a machine with one",
        ("tests/execution/test_gpu.py::test_engine_greedy_equal_across_backends",),
    ),
    # Quick start
    (
        "quick start",
        "Relay's dependencies include the `openai` client the Python example below uses",
        (
            "tests/project/test_readme.py::test_the_readme_openai_example_runs_against_a_server",
            "tests/project/test_readme.py::test_the_install_script_installs_the_no_deps_packages_last",
        ),
    ),
    (
        "quick start",
        "installed last, neither makes pip print a dependency conflict",
        (
            "tests/project/test_readme.py::test_the_install_script_installs_the_no_deps_packages_last",
        ),
    ),
    (
        "quick start",
        "engine = Engine()",
        ("tests/project/test_readme.py::test_the_readme_offline_example_runs",),
    ),
    # What you can do
    (
        "Serve OpenAI clients unmodified",
        "`/v1/completions`, `/v1/chat/completions`, `/v1/models`, streaming too",
        (
            "tests/server/test_server.py::test_models_and_health",
            "tests/server/test_server.py::test_chat_streaming_equals_non_streaming",
            "tests/server/test_server.py::test_completion_stream_n_seed_stop_logprobs",
            "tests/api/test_protocol.py::test_openai_client_reads_our_stream",
        ),
    ),
    (
        "Serve OpenAI clients unmodified",
        "SGLang's `/generate` (a batch too)",
        (
            "tests/server/test_server.py::test_completion_greedy_is_sensible_and_matches_generate",
            "tests/server/test_server.py::test_a_generate_batch_answers_as_its_prompts_alone_do",
        ),
    ),
    (
        "Serve OpenAI clients unmodified",
        "extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `priority`, ...)",
        (
            "tests/api/test_protocol.py::test_completion_fields_and_extras",
            "tests/scheduling/test_scheduler.py::test_priority_order_of_admission",
        ),
    ),
    (
        "Serve OpenAI clients unmodified",
        "prompt logprobs (`echo` with `logprobs` and `max_tokens: 0`, as lm-eval-harness sends, "
        "vLLM's `prompt_logprobs`, SGLang's `logprob_start_len`)",
        (
            "tests/api/test_prompt_logprobs.py::test_echo_with_logprobs_reads_as_lm_eval_reads_it",
            "tests/api/test_prompt_logprobs.py::test_vllm_prompt_logprobs_field",
            "tests/api/test_prompt_logprobs.py::test_generate_input_token_logprobs",
            "tests/api/test_prompt_logprobs.py::test_prompt_logprobs_equal_transformers_over_chunks_and_the_prefix_cache",
        ),
    ),
    (
        "Serve OpenAI clients unmodified",
        "a list of prompts in one completion request",
        (
            "tests/server/test_server.py::test_a_prompt_list_answers_as_its_prompts_alone_do_whole_and_streamed",
        ),
    ),
    (
        "Serve OpenAI clients unmodified",
        "lm-eval's `local-completions` scores as its `hf` model does",
        (
            "tests/server/test_lm_eval.py::test_lm_eval_local_completions_scores_as_its_hf_model_does",
        ),
    ),
    (
        "Serve agent clients",
        "OpenAI's Responses API (`/v1/responses`: function tools, structured output, reasoning "
        "items, streaming, `previous_response_id`) for the openai SDK and the OpenAI Agents SDK",
        (
            "tests/server/test_agent_apis_server.py::test_response_whole_streamed_and_the_sdk_stream_helper_agree",
            "tests/server/test_agent_apis_server.py::test_function_tool_round_trip_by_previous_response_id_and_by_items",
            "tests/server/test_agent_apis_server.py::test_structured_output_through_the_sdk_parse_helper",
            "tests/server/test_agent_apis_server.py::test_reasoning_is_a_reasoning_item_whole_and_streamed",
            "tests/server/test_agent_apis_server.py::test_the_agents_sdk_runs_a_tool_through_its_default_responses_model",
        ),
    ),
    (
        "Serve agent clients",
        "Anthropic's Messages API (`/v1/messages`, `count_tokens`) for the anthropic SDK",
        (
            "tests/server/test_agent_apis_server.py::test_message_whole_streamed_and_counted_agree",
            "tests/server/test_agent_apis_server.py::test_tool_use_round_trip_with_any_and_a_named_tool",
        ),
    ),
    (
        "Serve embeddings",
        "`--is-embedding` answers OpenAI's `/v1/embeddings`",
        (
            "tests/server/test_embeddings.py::test_embeddings_equal_transformers_batched_and_one_by_one",
            "tests/server/test_embeddings.py::test_openai_client_and_dimensions",
        ),
    ),
    (
        "Constrain output",
        "JSON schema, regex or EBNF (`response_format`, SGLang's and vLLM's fields)",
        (
            "tests/text/test_structured_output.py::test_outputs_validate_against_their_schemas",
            "tests/text/test_structured_output.py::test_outputs_fully_match_their_regexes",
            "tests/text/test_structured_output.py::test_ebnf",
            "tests/api/test_protocol.py::test_output_constraints",
            "tests/server/test_server.py::test_chat_response_format_json_schema_validates",
        ),
    ),
    (
        "Constrain output",
        "OpenAI tool calls with a parser per model family",
        (
            "tests/api/test_chat_parsers.py::test_tool_parser_whole_and_every_split_agree",
            "tests/server/test_chat_parsers_server.py::test_tool_call_format_comes_from_the_chat_template",
            "tests/server/test_server.py::test_forced_tool_call_validates_and_streams_the_same_call",
        ),
    ),
    (
        "Constrain output",
        "reasoning models' `<think>` split off",
        (
            "tests/api/test_chat_parsers.py::test_reasoning_parser_whole_and_every_split_agree",
            "tests/server/test_chat_parsers_server.py::test_response_format_rules_the_answer_after_the_reasoning",
        ),
    ),
    (
        "Serve many requests at once, fast",
        "continuous batching with priorities",
        (
            "tests/server/test_server.py::test_32_concurrent_streams",
            "tests/scheduling/test_scheduler.py::test_priority_order_of_admission",
            "tests/scheduling/test_scheduler.py::test_high_priority_arrival_retracts_a_lower_priority_request",
        ),
    ),
    (
        "Serve many requests at once, fast",
        "a paged KV cache",
        (
            "tests/scheduling/test_scheduler.py::test_tiny_pool_forces_retraction_but_tokens_match_a_huge_pool",
        ),
    ),
    (
        "Serve many requests at once, fast",
        "prefix reuse across requests (radix tree)",
        (
            "tests/server/test_server.py::test_prefix_cache_reported",
            "tests/memory/test_radix_cache.py::test_insert_then_match",
            "tests/scheduling/test_scheduler.py::test_shared_prefix_is_computed_once",
        ),
    ),
    (
        "Serve many requests at once, fast",
        "chunked prefill beside running decodes",
        (
            "tests/scheduling/test_scheduler.py::test_chunked_prefill_splits_a_long_prompt_within_the_budget",
            "tests/scheduling/test_scheduler.py::test_decodes_are_in_every_step_and_share_the_budget_with_prefill",
        ),
    ),
    (
        "Serve many requests at once, fast",
        "on a CPU Relay picks bfloat16 where the CPU has bf16 instructions",
        (
            "tests/project/test_readme.py::test_auto_dtype_is_bfloat16_only_where_the_cpu_has_bf16_instructions",
        ),
    ),
    (
        "Serve many requests at once, fast",
        "runs its own C kernels for every instruction-set level from AVX2 (or plain C) to AMX",
        (
            # kernel_level: every level the test machine reaches (AMX only on an AMX CPU)
            "tests/execution/kernels/test_cpu_kernels.py::test_decode_attention_matches_dense",
            "tests/execution/kernels/test_one_call_decoders.py::test_a_decode_step_in_one_c_call_is_the_layers_bit_for_bit",
            "tests/execution/kernels/test_isa.py::test_a_server_held_to_avx2_serves_and_says_so",
        ),
    ),
    (
        "Trade latency for throughput on purpose",
        "`--target-itl-ms` keeps p99 inter-token latency under a target",
        (
            "tests/scheduling/test_adaptive_batching.py::test_fixed_limits_miss_a_tight_target_that_adaptive_limits_meet_on_a_steady_load",
            "tests/scheduling/test_adaptive_batching.py::test_the_server_steers_its_limits_under_load_and_shows_them",
        ),
    ),
    (
        "Trade latency for throughput on purpose",
        "`--max-decode-stall-ms` bounds how long a burst of prompts may pause decoding",
        (
            "tests/scheduling/test_scheduler.py::test_a_decoding_request_yields_once_and_at_most_max_decode_stall_ms",
        ),
    ),
    (
        "Get transformers' output exactly, or reproducibly and faster",
        "`--deterministic` gives transformers' float32 greedy output token for token",
        (
            "tests/test_engine.py::test_default_model_matches_transformers",
            "tests/project/test_readme.py::test_deterministic_is_float32_on_float_activations_and_refuses_the_rest",
        ),
    ),
    (
        "Get transformers' output exactly, or reproducibly and faster",
        "the defaults' greedy output is the same alone, in a crowded step, after a prefix-cache hit "
        "and after a restart",
        ("tests/project/test_readme.py::test_greedy_output_with_the_defaults_is_reproducible",),
    ),
    (
        "Go faster where output may change slightly, or not at all",
        "speculative decoding (`ngram` prompt lookup or a draft model; greedy output unchanged with "
        "`--deterministic`",
        (
            "tests/scheduling/test_speculative.py::test_greedy_output_is_unchanged_by_speculation",
            "tests/scheduling/test_speculative.py::test_default_model_greedy_output_is_unchanged_by_a_quantized_self_draft",
            "tests/server/test_speculative_server.py::test_a_draft_model_through_the_server_keeps_greedy_output",
        ),
    ),
    (
        "Go faster where output may change slightly, or not at all",
        "`--quantization int8|int4|w8a8`",
        (
            "tests/execution/weights/test_quantization.py::test_default_model_int8_matches_transformers_on_the_quantized_weights",
            "tests/execution/weights/test_quantization.py::test_default_model_int4_is_still_the_model",
            "tests/execution/weights/test_quantization.py::test_a_safetensors_model_quantized_at_load_is_served_from_blocks_alone",
            "tests/execution/weights/test_quantization.py::test_default_model_w8a8_is_still_the_model",
        ),
    ),
    (
        "Go faster where output may change slightly, or not at all",
        "AWQ / GPTQ 4-bit checkpoints served from the CPU block kernels with no float copy",
        (
            "tests/execution/weights/test_quantized_checkpoints.py::test_4bit_checkpoints_are_exact_blocks_and_match_transformers",
            "tests/execution/weights/test_quantized_checkpoints.py::test_off_the_block_kernels_4bit_weights_are_the_dequantized_floats",
        ),
    ),
    (
        "Scale out",
        "`--tp N` (shared memory across one machine's CPU cores",
        (
            "tests/execution/test_tp_shared_memory.py::test_shared_memory_collectives_sum_gather_and_fail_loudly",
            "tests/server/test_server_lifecycle.py::test_tp2_equals_tp1_with_deterministic",
        ),
    ),
    (
        "Scale out",
        "gloo across machines",
        ("tests/launch/test_multinode.py::test_two_nodes_equal_tp1_and_a_dead_node_stops_node0",),
    ),
    (
        "Scale out",
        "NCCL on GPUs, whose test needs a GPU",
        ("tests/execution/test_gpu.py::test_tp_group_over_nccl",),
    ),
    (
        "Scale out",
        "greedy output equal to `--tp 1`'s with `--deterministic`",
        ("tests/server/test_server_lifecycle.py::test_tp2_equals_tp1_with_deterministic",),
    ),
    (
        "Scale out",
        "`--dp N` replicas behind sglang-router with cache-aware routing",
        (
            "tests/launch/test_scale_out.py::test_openai_client_through_the_router",
            "tests/launch/test_scale_out.py::test_cache_aware_routing_hits_the_cache_more_than_round_robin",
        ),
    ),
    (
        "Run it offline",
        "`relay.Engine` in one process, the same scheduler and runner",
        (
            "tests/test_engine.py::test_default_model_matches_transformers",
            "tests/project/test_readme.py::test_the_readme_offline_example_runs",
        ),
    ),
    (
        "Operate it",
        "Prometheus `/metrics`, TTFT and inter-token latency",
        (
            "tests/server/test_server.py::test_server_healthy_after_bad_inputs_and_metrics",
            "tests/test_metrics.py::test_names_are_present",
        ),
    ),
    (
        "Operate it",
        "per-request and per-step logs",
        (
            "tests/launch/test_scale_out.py::test_a_request_id_reaches_the_replicas_log_line",
            "tests/scheduling/test_scheduler.py::test_step_log_line_tells_prompt_chunks_from_decodes",
        ),
    ),
    (
        "Operate it",
        "a 4xx JSON error naming the field for every bad input",
        (
            "tests/server/test_server.py::test_bad_input_gets_4xx_naming_the_field",
            "tests/api/test_protocol.py::test_bad_requests",
            "tests/server/test_hardening.py::test_schema_driven_fuzz_never_gets_a_server_error",
        ),
    ),
    (
        "Operate it",
        "aborts that free the KV cache (client disconnects too)",
        (
            "tests/server/test_server.py::test_disconnect_aborts_and_frees_kv",
            "tests/server/test_server.py::test_abort_request_endpoint",
        ),
    ),
    (
        "Operate it",
        "graceful shutdown",
        (
            "tests/api/test_drain.py::test_requests_that_finish_in_time_are_not_aborted",
            "tests/api/test_drain.py::test_what_is_still_running_at_the_timeout_is_aborted_with_an_error_naming_the_flag",
        ),
    ),
    (
        "Operate it",
        "a supervisor that never leaves a hung server or an orphan process",
        (
            "tests/server/test_server_lifecycle.py::test_child_death_fails_requests_and_exits",
            "tests/server/test_server_lifecycle.py::test_process_titles_and_sigterm_leaves_no_orphans",
            "tests/server/test_server_lifecycle.py::test_terminating_a_session_ends_what_outlives_its_leader",
        ),
    ),
    (
        "Measure it",
        "`python -m scripts.bench` runs the same workloads against Relay and, once their scripts "
        "have installed them, vLLM's CPU build and llama.cpp",
        (
            "tests/bench/test_bench_workloads.py::test_every_subcommand_parses_its_help",
            "tests/bench/test_bench_workloads.py::test_compare_relay_variants",
            "tests/bench/test_bench_workloads.py::test_compare_table_keeps_a_failed_run_as_a_row",
        ),
    ),
    (
        "Measure it",
        "`scripts/default_quality.py` what the defaults cost against `--deterministic` on this CPU",
        ("tests/project/test_readme.py::test_default_quality_script_parses_its_help",),
    ),
]
