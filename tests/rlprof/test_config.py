"""The config schema: every YAML block and command line of the seed loads and means what the seed says;
each kind of bad config fails at load time with an error naming the key, the value and what is allowed."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlprof.config import ConfigError, RoleProfilerConfig, load_config

# The seed's YAML blocks, verbatim (verl monitoring guide, shared/seed/).
SEED_MEMORY = """
global_profiler:
  tool: torch_memory          # 分析工具类型
  save_path: ./mem_snapshots  # 分析结果保存路径
  global_tool_config:
    torch_memory:
      trace_alloc_max_entries: 100000  # 内存分配跟踪条目数
      stack_depth: 32                  # 堆栈跟踪深度

# 训练器日志配置
trainer:
  logger: ["console", "wandb"]  # 日志输出目标
  project_name: 'multi-turn-grpo'  # W&B项目名称
  experiment_name: 'qwen2.5-3b-experiment'  # 实验名称
"""
SEED_NSYS = """
global_profiler:
  tool: nsys
  save_path: ./nsys_profiles
  global_tool_config:
    nsys:
      discrete: false  # true: 每个任务独立数据库, false: 共享数据库

actor_rollout_ref:
  actor:
    profiler:
      enable: true
      all_ranks: false
      ranks: [0]  # 仅分析rank 0
"""
SEED_MEMORY_2 = """
global_profiler:
  tool: torch_memory
  save_path: ./memory_analysis
  global_tool_config:
    torch_memory:
      trace_alloc_max_entries: 100000  # 跟踪10万个内存分配事件
      stack_depth: 32                  # 32层堆栈深度跟踪

# 启用内存优化特性
actor_rollout_ref:
  ref:
    entropy_from_logits_with_chunking: true  # 分块计算熵值减少内存峰值
  actor:
    entropy_checkpointing: true  # 熵计算重计算优化内存
"""
SEED_TORCH = """
global_profiler:
  tool: torch
  global_tool_config:
    torch:
      step_start: 100  # 从第100步开始分析
      step_end: 200    # 到第200步结束分析
"""
SEED_MULTITURN_CLI = [
    "global_profiler.tool=torch_memory",
    "global_profiler.save_path=./mem_snapshots",
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000",
    "global_profiler.global_tool_config.torch_memory.stack_depth=32",
    'trainer.logger=["console","wandb"]',
]
SEED_OOM_CLI = ["global_profiler.tool=torch_memory", "global_profiler.save_path=./oom_analysis"]


@pytest.mark.parametrize("text", [SEED_MEMORY, SEED_MEMORY_2], ids=["memory", "memory-opt"])
def test_seed_memory_blocks_select_torch_memory_with_their_limits(text):
    config = load_config(text)
    gp = config.global_profiler
    assert gp.tool == "torch_memory"
    assert gp.global_tool_config.torch_memory.trace_alloc_max_entries == 100_000
    assert gp.global_tool_config.torch_memory.stack_depth == 32
    assert config.step_selection().selects_all  # no steps given: the whole run is recorded


def test_seed_nsys_block_profiles_actor_on_rank_0_in_one_shared_capture():
    config = load_config(SEED_NSYS, world_size=4)
    assert config.global_profiler.tool == "nsys"
    assert config.global_profiler.save_path == "./nsys_profiles"
    assert config.global_profiler.global_tool_config.nsys.discrete is False
    assert config.roles == {"actor": RoleProfilerConfig(enable=True, all_ranks=False, ranks=[0])}


def test_seed_torch_block_records_steps_100_to_200_inclusive():
    selection = load_config(SEED_TORCH).step_selection()
    assert 99 not in selection and 100 in selection and 200 in selection and 201 not in selection


@pytest.mark.parametrize("argv", [SEED_MULTITURN_CLI, SEED_OOM_CLI], ids=["multiturn", "oom"])
def test_seed_command_line_overrides_load(argv):
    config = load_config(OmegaConf.from_dotlist(argv))
    assert config.global_profiler.tool == "torch_memory"
    assert config.global_profiler.save_path in ("./mem_snapshots", "./oom_analysis")


def test_roles_are_found_anywhere_and_reward_model_is_the_reward_role():
    config = load_config(
        {
            "actor_rollout_ref": {"rollout": {"profiler": {"ranks": [1]}}, "ref": {"profiler": {"enable": False}}},
            "critic": {"profiler": {"all_ranks": True}},
            "reward_model": {"profiler": {}},
            "my_env": {"profiler": {"ranks": [0, 1]}},
        }
    )
    assert set(config.roles) == {"rollout", "ref", "critic", "reward", "my_env"}
    assert config.roles["rollout"].ranks == [1] and config.roles["critic"].all_ranks


def expect_error(cfg, *fragments, world_size=None):
    with pytest.raises(ConfigError) as info:
        load_config(cfg, world_size=world_size)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_unknown_key_names_it_suggests_the_nearest_and_lists_the_allowed():
    expect_error(
        {"global_profiler": {"tool": "torch", "global_tool_config": {"torch": {"step_strat": 1}}}},
        "global_profiler.global_tool_config.torch.step_strat",
        "did you mean 'step_start'",
        "allowed keys:",
    )


def test_unknown_key_in_a_role_block():
    expect_error({"critic": {"profiler": {"rank": [0]}}}, "critic.profiler.rank", "did you mean 'ranks'")


def test_unknown_tool_lists_the_tools():
    expect_error(
        {"global_profiler": {"tool": "npu"}}, "global_profiler.tool", "'npu'", "nsys, range_times, torch, torch_memory"
    )


def test_negative_step():
    expect_error({"global_profiler": {"tool": "torch", "steps": [1, -2]}}, "global_profiler.steps[1]", "-2", ">= 0")


def test_negative_window_start():
    expect_error(
        {"global_profiler": {"tool": "torch", "global_tool_config": {"torch": {"step_start": -1}}}},
        "torch.step_start",
        "-1",
        ">= 0",
    )


def test_window_that_ends_before_it_starts():
    expect_error(
        {"global_profiler": {"tool": "torch", "global_tool_config": {"torch": {"step_start": 5, "step_end": 3}}}},
        "global_profiler.global_tool_config.torch.step_end",
        "3",
        "step_start=5",
        "step_end >= step_start",
    )


def test_steps_that_conflict_with_the_window():
    expect_error(
        {
            "global_profiler": {
                "tool": "torch",
                "steps": [1, 7],
                "global_tool_config": {"torch": {"step_start": 2, "step_end": 4}},
            }
        },
        "global_profiler.steps=[1, 7]",
        "step_start=2",
        "step_end=4",
        "either",
    )


def test_steps_that_spell_out_the_window_are_accepted():
    config = load_config(
        {
            "global_profiler": {
                "tool": "torch",
                "steps": [2, 3, 4],
                "global_tool_config": {"torch": {"step_start": 2, "step_end": 4}},
            }
        }
    )
    assert sorted(config.step_selection().steps) == [2, 3, 4]


def test_rank_outside_the_world_is_a_warning_as_in_verl_and_a_negative_rank_an_error():
    """A verl script moved to fewer GPUs keeps its ``ranks=[0,4]``: verl records nothing for rank 4; so does rlprof,
    and says so."""
    with pytest.warns(RuntimeWarning, match=r"actor\.profiler\.ranks\[1\]: rank 4 is outside the world \(world_size=4"):
        config = load_config(OmegaConf.create(SEED_NSYS.replace("ranks: [0]", "ranks: [0, 4]")), world_size=4)
    assert config.roles["actor"].ranks == [0, 4]
    expect_error(SEED_NSYS.replace("ranks: [0]", "ranks: [-1]"), "actor.profiler.ranks[0]", "rank -1 is negative")


def test_wrong_types_name_the_key():
    expect_error({"global_profiler": {"steps": "2,3"}}, "global_profiler.steps", "expected a list", "'2,3'")
    expect_error({"actor": {"profiler": {"enable": "yes"}}}, "actor.profiler.enable", "true or false")
    expect_error(
        {"global_profiler": {"tool": "torch", "global_tool_config": {"torch": {"contents": ["gpu"]}}}},
        "contents[0]",
        "'gpu'",
        "cpu, cuda, shapes, stack, memory",
    )


def test_yaml_file_path(tmp_path):
    path = tmp_path / "profile.yaml"
    path.write_text(SEED_NSYS, encoding="utf-8")
    assert load_config(str(path)).global_profiler.tool == "nsys"
