"""The multi-turn, tool-calling rollout: calls read from the policy's text, tools run with verl's lifecycle and a
timeout, masks exact on a known conversation, turn and length limits, the step's metrics; GSM8K scoring and verl's
GSM8K tool against verl's own ``gsm8k.py`` (tests/data/verl, Apache-2.0); verl's tool config loaded.

The conversation tests drive the loop with a backend that answers each turn with given text (a known conversation,
tokenised by the embedded model's real tokenizer); the end-to-end runs are in ``test_multi_turn_runs.py``."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import time
from pathlib import Path

import pytest

from rlprof_train.agent.builtin import CALCULATOR_SCHEMA, CalculatorTool, Gsm8kTool, evaluate
from rlprof_train.agent.parser import hermes_call, parse_hermes
from rlprof_train.agent.stats import multi_turn_metrics
from rlprof_train.agent.tool import Tool
from rlprof_train.agent.tool_config import load_tools
from rlprof_train.config.schema import MultiTurnConfig
from rlprof_train.data import Example
from rlprof_train.reward_functions import RewardFunction, gsm8k_score
from rlprof_train.tiny_model import build_tokenizer, task_corpus
from rlprof_train.workers.reward_worker import RewardWorker
from rlprof_train.workers.rollout.base import Completion, Completions, Rollout, SamplingParams
from rlprof_train.workers.rollout.multi_turn import MultiTurnRollout, ToolReplies, truncate_reply

DATA = Path(__file__).parents[1] / "data"
GSM8K_TOOLS = (
    DATA / "verl_scripts" / "examples" / "sglang_multiturn" / "config" / "tool_config" / "gsm8k_tool_config.yaml"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_corpus("calculator", 0))


class Scripted(Rollout):
    """A backend whose turns are given: ``turns[k]`` is the text every trajectory generates at its turn k."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.contexts = tokenizer, turns, []

    def generate(self, prompts, sampling):
        raise AssertionError("the multi-turn loop continues sequences")

    def complete(self, contexts, n, budgets, sampling, keys):
        assert len(keys) == len(contexts) and len(set(keys)) == len(keys)  # each context its own noise
        self.contexts.append([list(c) for c in contexts])
        text = self.turns[min(len(self.contexts), len(self.turns)) - 1]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Completions(
            [Completion(ids[:budget], [-0.5] * len(ids[:budget])) for budget in budgets for _ in range(n)]
        )


def rollout(tokenizer, turns, tools=(), length=64, n=1, **settings):
    backend = Scripted(tokenizer, turns)
    prompt = Example(0, tuple(tokenizer("3*4=", add_special_tokens=False)["input_ids"]), "rlprof/calculator", "12")
    looped = MultiTurnRollout(backend, list(tools), MultiTurnConfig(enable=True, **settings), tokenizer)
    try:
        return looped.generate([prompt], SamplingParams(n, 1.0, 1.0, -1, length)), backend
    finally:
        looped.close()


def ids(tokenizer, text, eos=False):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])


def test_hermes_calls_are_read_and_unusable_ones_carry_their_error():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call> and '
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": 3}</tool_call>'
        '<tool_call>not json</tool_call><tool_call>{"name": "g", "arguments": [1]}</tool_call><tool_call>{"na'
    )
    calls = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "3*4"}), ("f", {"x": 1})]
    assert [c.error is None for c in calls] == [True, True, False, False, False, False]
    assert 'no "name"' in calls[2].error and "not JSON" in calls[3].error and "not an object" in calls[4].error
    assert "never closed" in calls[5].error
    assert parse_hermes("12") == [] and parse_hermes(hermes_call("calculator", {"expression": "1+1"}))[0].name
    assert "over" in parse_hermes("<tool_call>" + "1" * 70_000 + "</tool_call>")[0].error


def test_the_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert evaluate("12*7") == 84 and evaluate("(2+3)**2 - 7 // 2") == 22 and evaluate("-3 % 5") == 2
    for bad, reason in (
        ("__import__('os')", "not allowed"),
        ("9**99999", "too large"),
        ("1/0", "division by zero"),
        ("2 +", "not an arithmetic expression"),
        ("1" * 300, "characters long"),
        ("True + 1", "not allowed"),
    ):
        with pytest.raises(ValueError, match=reason):
            evaluate(bad)
    reply, reward, _ = CalculatorTool({}, CALCULATOR_SCHEMA).execute("i", {"expression": "6/3"})
    assert reply.text == "2" and reward == 0.0


def verl_gsm8k():
    spec = importlib.util.spec_from_file_location("verl_gsm8k", DATA / "verl" / "gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gsm8k_scores_as_verls_own_function_on_strict_and_flexible_answers():
    verl = verl_gsm8k()
    rng = random.Random(0)
    pieces = ["#### ", "####", "The answer is ", "12", "1,200", "-3", "3.5", ".", "$", " ", "\n", "x" * 290, "#### 7"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))) for _ in range(2000)]
    for text in texts:
        for truth in ("12", "1200", "-3", "3.5", "7"):
            for method in ("strict", "flexible"):
                assert gsm8k_score(text, truth, method) == verl.compute_score(text, truth, method=method), (text, truth)


def test_the_gsm8k_tool_rewards_an_improvement_and_penalises_a_resubmission_as_verl():
    (tool,) = load_tools(str(GSM8K_TOOLS))  # verl's own tool config: class_name verl.tools.gsm8k_tool.Gsm8kTool
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"
    instance, _ = tool.create(create_kwargs={"ground_truth": "72"})
    first = tool.execute(instance, {"answer": "70"})
    assert first[0].text == "Current parsed answer='70' reward=0.0" and first[1] == -0.05  # not better than 0
    assert tool.execute(instance, {"answer": 72})[1:] == (0.0, {})  # improved: no penalty
    assert tool.execute(instance, {"answer": "#### 72"})[1] == -0.05 and tool.calc_reward(instance) == 1.0
    tool.release(instance)


def test_a_tool_config_with_problems_names_each_of_them_in_one_error(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(
        "tools:\n"
        "  - class_name: no.such.Module\n    tool_schema: {type: function, function: {name: a}}\n"
        "  - class_name: rlprof_train.agent.builtin.CalculatorTool\n    tool_schema: {type: function}\n"
        "  - class_name: builtins.dict\n    tool_schema: {type: function, function: {name: 'b c'}}\n"
        + "  - class_name: rlprof_train.agent.builtin.CalculatorTool\n"
        "    tool_schema: {type: function, function: {name: d}}\n" * 2
    )
    with pytest.raises(ValueError) as raised:
        load_tools(str(config))
    message = str(raised.value)
    assert message.count("\n") == 0 and message.startswith("actor_rollout_ref.rollout.multi_turn.tool_config_path=")
    for fragment in (
        "tools[0].class_name='no.such.Module': module no.such does not import",
        "tools[1].tool_schema",
        "tools[2].tool_schema.function.name='b c'",
        "two tools are named 'd'",
    ):
        assert fragment in message, message
    with pytest.raises(ValueError, match="no such file"):
        load_tools(str(tmp_path / "missing.yaml"))


def test_a_known_conversation_keeps_the_replies_attended_and_out_of_the_policys_mask(tokenizer):
    call = hermes_call("calculator", {"expression": "3*4"})
    batch, backend = rollout(tokenizer, [call, "12"], [CalculatorTool({}, CALCULATOR_SCHEMA)])
    turn1, reply, turn2 = (
        ids(tokenizer, call, eos=True),
        ToolReplies(tokenizer).tokens(["12"]),
        ids(tokenizer, "12", True),
    )
    assert tokenizer.decode(reply) == "\n<tool_response>\n12\n</tool_response>\n"
    real = len(turn1) + len(reply) + len(turn2)
    assert batch.responses[0, :real].tolist() == turn1 + reply + turn2
    assert batch.response_mask[0].tolist() == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2) + [0] * (64 - real)
    assert batch.response_attention[0].tolist() == [1] * real + [0] * (64 - real)
    assert batch.response_lengths().tolist() == [real] and batch.last_policy_token().tolist() == [real - 1]
    prompt = list(batch.input_ids[0, : batch.prompt_length])
    assert backend.contexts[1] == [prompt + turn1 + reply]  # the second turn continues the whole conversation
    assert (batch.extras["rollout_log_probs"][0] == -0.5 * batch.response_mask[0]).all()  # tool tokens: 0
    (info,) = batch.extras["reward_extra_info"]
    assert info == {"num_turns": 4, "tool_rewards": [0.0], "rollout_reward_scores": {"calculator": 0.0}}
    # the reward function reads the whole conversation; the score sits on the last token the policy sampled
    scored = RewardWorker(RewardFunction(), tokenizer).score(batch)
    assert scored.token_level[0, real - 1] == 1.0 and scored.token_level.sum() == 1.0
    assert scored.metrics.compute()["reward_extra/correct_call"] == 1.0 and scored.per_response["correct_call"] == [1.0]


def test_malformed_unknown_failing_and_hanging_calls_are_answered_counted_and_survived(tokenizer):
    class Hangs(Tool):
        def execute(self, instance_id, parameters, **kwargs):
            time.sleep(30)

    class Raises(Tool):
        async def execute(self, instance_id, parameters, **kwargs):  # an async tool, as verl writes them
            await asyncio.sleep(0)
            raise RuntimeError("the sandbox is down")

    def schema(name):
        return {"type": "function", "function": {"name": name}}

    turn = "".join(
        [hermes_call("hang", {}), hermes_call("boom", {}), hermes_call("nope", {}), "<tool_call>{oops}</tool_call>"]
    )
    start = time.monotonic()
    batch, _ = rollout(
        tokenizer,
        [turn, "5"],
        [Hangs({}, schema("hang")), Raises({}, schema("boom"))],
        length=512,
        max_parallel_calls=4,
        tool_timeout_s=0.5,
    )
    assert time.monotonic() - start < 10  # the hanging call is given up after its timeout
    text = tokenizer.decode(batch.responses[0][batch.response_attention[0].bool()])
    assert "took longer than multi_turn.tool_timeout_s=0.5 s" in text and "RuntimeError: the sandbox is down" in text
    assert "there is no tool 'nope'; the tools are: boom, hang" in text and "not JSON" in text
    records = batch.extras["multi_turn"]
    metrics = multi_turn_metrics(records["trajectories"], records["calls"], records["splits"])
    assert metrics["tools/hang/failures"] == 1 and metrics["tools/boom/failures"] == 1
    assert metrics["tools/malformed_calls"] == 2 and metrics["tool_call_counts/max"] == 4
    assert metrics["tools/hang/latency_ms_p50"] == pytest.approx(500)
    assert metrics["num_turns/max"] == 4  # the replies went back (one turn) and the policy answered


def test_turn_and_length_limits_end_trajectories_as_verl(tokenizer):
    call = hermes_call("calculator", {"expression": "1+1"})
    tools = [CalculatorTool({}, CALCULATOR_SCHEMA)]
    batch, backend = rollout(tokenizer, [call], tools, length=512, max_assistant_turns=3)
    assert len(backend.contexts) == 3 and batch.extras["reward_extra_info"][0]["num_turns"] == 1 + 3 + 2
    batch, backend = rollout(tokenizer, [call], tools, length=512, max_user_turns=1)
    assert len(backend.contexts) == 2 and batch.extras["reward_extra_info"][0]["num_turns"] == 1 + 2 + 1
    one_call = len(ids(tokenizer, call, eos=True))
    batch, backend = rollout(tokenizer, [call], tools, length=one_call + 3)  # the reply would not fit: the end
    assert len(backend.contexts) == 1 and batch.response_lengths().tolist() == [one_call]
    batch, _ = rollout(tokenizer, [call], tools, length=one_call - 2)  # cut by the length: no call is read
    assert batch.extras["multi_turn"]["calls"] == [] and batch.response_mask.sum() == one_call - 2
    batch, backend = rollout(tokenizer, [call, "2"], tools, n=3, length=512)
    assert len(backend.contexts[0]) == 1 and len(backend.contexts[1]) == 3  # one prompt, its n samples continued
    assert batch.uid == [0, 0, 0] and batch.extras["multi_turn"]["trajectories"][0].tool_calls == 1


class Streaming(Rollout):
    """One trajectory's scripted turns, continued where a call stopped: each call gives the next ``budget`` tokens
    of the current turn (its text and EOS), then the next turn."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.turns = [ids(tokenizer, text, eos=True) for text in turns]
        self.turn, self.offset, self.budgets = 0, 0, []

    def generate(self, prompts, sampling):
        raise AssertionError("the multi-turn loop continues sequences")

    def complete(self, contexts, n, budgets, sampling, keys):
        assert len(contexts) == n == 1, "one trajectory"
        tokens = self.turns[min(self.turn, len(self.turns) - 1)]
        part = tokens[self.offset : self.offset + budgets[0]]
        self.offset += len(part)
        if self.offset == len(tokens):
            self.turn, self.offset = self.turn + 1, 0
        self.budgets.append(budgets[0])
        return Completions([Completion(part, [-0.5] * len(part))])


def test_in_segments_a_turn_cut_goes_on_in_the_next_call_and_the_process_is_asked_between_calls(tokenizer):
    """Partial rollouts of a multi-turn trajectory (the fully-async trainer's ``partial_rollout``): calls of at most
    a segment's tokens; a turn cut by one goes on in the next call, counted once, its tool call read when it ends;
    after each call the rollout process is told which trajectories sampled and which go on (where it takes a weight
    sync). The trajectory is the one sampled without segments, token for token."""
    from rlprof_train.workers.rollout.multi_turn import Segments

    call = hermes_call("calculator", {"expression": "3*4"})
    prompt = Example(0, tuple(ids(tokenizer, "3*4=")), "rlprof/calculator", "12")
    batches, asked = [], []
    for segment in (None, 4):
        backend = Streaming(tokenizer, [call, "12"])
        looped = MultiTurnRollout(
            backend, [CalculatorTool({}, CALCULATOR_SCHEMA)], MultiTurnConfig(enable=True), tokenizer
        )
        if segment is not None:
            looped.segments = Segments(segment, lambda sampled, going: asked.append((sampled, going)))
        try:
            batches.append((looped.generate([prompt], SamplingParams(1, 1.0, 1.0, -1, 256)), backend.budgets))
        finally:
            looped.close()
    (whole, whole_budgets), (cut, cut_budgets) = batches
    assert len(whole_budgets) == 2 and len(cut_budgets) > 4 and max(cut_budgets) == 4
    assert cut.responses.tolist() == whole.responses.tolist()
    assert cut.response_mask.tolist() == whole.response_mask.tolist()
    assert cut.extras["reward_extra_info"] == whole.extras["reward_extra_info"]  # turns (1 + 2 + 1) and the reward
    assert cut.extras["multi_turn"]["trajectories"][0].tool_calls == 1
    assert len(asked) == len(cut_budgets) and all(sampled == [0] for sampled, _ in asked)
    assert [going for _, going in asked] == [[0]] * (len(asked) - 1) + [[]]


def test_long_replies_are_cut_as_verl_cuts_them():
    text = "abcdefghij"
    assert truncate_reply(text, 4, "left") == "abcd...(truncated)"
    assert truncate_reply(text, 4, "right") == "(truncated)...ghij"
    assert truncate_reply(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate_reply(text, 10, "middle") == text


def test_a_chat_template_renders_replies_without_its_system_prompt(tokenizer):
    tokenizer = build_tokenizer(task_corpus("calculator", 0))
    tokenizer.chat_template = (
        "<|system|>be brief\n{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert tokenizer.decode(ToolReplies(tokenizer).tokens(["12", "7"])) == "<|tool|>12\n<|tool|>7\n<|assistant|>"


def test_metrics_summarise_turns_calls_latency_and_the_time_split():
    from rlprof_train.agent.stats import RolloutSplit, ToolCallRecord, TrajectoryRecord

    trajectories = [TrajectoryRecord(3, 1, 20, 1.0), TrajectoryRecord(5, 2, 40, 2.5), TrajectoryRecord(1, 0, 5, 0.2)]
    calls = [ToolCallRecord("calc", s, f) for s, f in ((0.1, False), (0.3, True), (0.2, False))]
    metrics = multi_turn_metrics(trajectories, [*calls, ToolCallRecord("", 0.0, True)], [RolloutSplit(4.0, 3.0, 0.5)])
    assert metrics["num_turns/mean"] == 3 and metrics["tool_call_counts/max"] == 2
    assert metrics["tools/calc/calls"] == 3 and metrics["tools/calc/failures"] == 1
    assert metrics["tools/calc/latency_ms_p50"] == pytest.approx(200) and metrics["tools/malformed_calls"] == 1
    assert metrics["rollout/generation_share"] == 0.75 and metrics["rollout/tool_wait_share"] == 0.125
    assert metrics["rollout/slowest_trajectory/turns"] == 5 and metrics["rollout/slowest_trajectory/length"] == 40
    assert multi_turn_metrics([], [], []) == {}


def test_tool_calls_follow_the_rollout_roles_block_else_the_actors():
    from rlprof.roles import RoleProfilerConfig, role_enabled

    actor_only = {"actor": RoleProfilerConfig(ranks=[1])}
    assert role_enabled(actor_only, "tool", 1) and not role_enabled(actor_only, "tool", 0)
    rollout_off = {**actor_only, "rollout": RoleProfilerConfig(enable=False)}
    assert not role_enabled(rollout_off, "tool", 1)
    assert not role_enabled({"critic": RoleProfilerConfig()}, "tool", 0)


def test_prompts_are_rendered_with_the_tools_schemas_where_the_template_renders_them(tokenizer):
    from rlprof_train.data import build_examples

    tokenizer = build_tokenizer(task_corpus("calculator", 0))
    tokenizer.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    rows = [{"prompt": [{"role": "user", "content": "3*4="}], "data_source": "rlprof/calculator"}]
    common = dict(prompt_key="prompt", max_prompt_length=64, truncation="error", use_template="auto", source_name="x")
    (with_tools,), _ = build_examples(rows, tokenizer, tools=[CALCULATOR_SCHEMA], **common)
    (without,), _ = build_examples(rows, tokenizer, **common)
    assert tokenizer.decode(with_tools.prompt_ids) == "<tools>calculator;</tools>3*4="
    assert tokenizer.decode(without.prompt_ids) == "3*4="


def test_multi_turn_on_a_backend_that_cannot_continue_sequences_is_one_config_error(monkeypatch):
    from rlprof.typed_config import ConfigError
    from rlprof_train.config.load import load_trainer_config
    from rlprof_train.preflight import validate
    from rlprof_train.workers.rollout import registry
    from rlprof_train.workers.rollout.registry import register_rollout

    monkeypatch.setattr(registry, "_ROLLOUTS", dict(registry._ROLLOUTS))  # registrations of this test only

    @register_rollout("single_turn_only")
    class SingleTurnOnly(Rollout):
        def generate(self, prompts, sampling): ...

    with pytest.raises(ConfigError) as raised:
        validate(load_trainer_config(["--config-name=tool_demo", "actor_rollout_ref.rollout.name=single_turn_only"]))
    message = str(raised.value)
    assert message.count("\n") == 0, message
    assert "actor_rollout_ref.rollout.name='single_turn_only'" in message and "continues token sequences" in message
    assert message.endswith(": hf, vllm"), message
    validate(load_trainer_config(["--config-name=demo", "actor_rollout_ref.rollout.name=single_turn_only"]))  # 1 turn
    with pytest.raises(TypeError, match="does not subclass ContinuingRollout"):
        register_rollout("claims_it", continues=True)(SingleTurnOnly)
