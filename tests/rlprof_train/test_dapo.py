"""DAPO as verl runs it, compared with verl's own code on the same seeded inputs (tests/data/verl, Apache-2.0, see
SOURCES.tsv): the DAPO reward manager's overlong penalty (``verl/workers/reward_manager/dapo.py``), dynamic
sampling's choice of groups (the DAPO recipe's ``RayDAPOTrainer.fit``), the learning-rate warm-up and decay
(``verl/utils/torch_functional.py``); and how a step's groups are assembled across ranks, validation sampling, the
model config overrides and the config checks."""

from __future__ import annotations

import ast
import json
import math
import random
import subprocess
import textwrap
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from verl_source import verl_functions

from rlprof.cli import main
from rlprof.tracking.jsonl import read_jsonl
from rlprof_train.batch import RolloutBatch
from rlprof_train.config.load import load_trainer_config
from rlprof_train.config.schema import FilterGroupsConfig, OptimConfig, OverlongBufferConfig, ValKwargs
from rlprof_train.data import left_pad
from rlprof_train.dynamic_sampling import Round, Rounds, assemble, groups_with_variance
from rlprof_train.lr_schedule import LRSchedule
from rlprof_train.models import load_causal_lm, overridden_config
from rlprof_train.preflight import validate
from rlprof_train.reward_functions import RewardFunction, default_compute_score
from rlprof_train.tiny_model import build_tokenizer, create_tiny_model
from rlprof_train.trainer import validation_sampling
from rlprof_train.workers.reward_worker import RewardWorker

from conftest import ROOT, subprocess_env, trainer_command

DATA = Path(__file__).parents[1] / "data" / "verl"


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [
        f"What is {a} plus {b}? Answer: {a + b}\\boxed{{{a + b}}} #### {a + b}" for a in range(30) for b in range(30)
    ]
    return build_tokenizer(corpus, vocab_size=400)


# ----------------------------------------------------------------------------------------- the DAPO reward manager


class Item:
    """One row of verl's ``DataProto`` as the reward manager reads it."""

    def __init__(self, batch: dict[str, torch.Tensor], non_tensor: dict[str, Any]) -> None:
        self.batch, self.non_tensor_batch = batch, non_tensor


class Proto:
    """The parts of verl's ``DataProto`` its reward managers read: ``len``, rows, ``batch["responses"]``."""

    def __init__(self, rows: list[Item]) -> None:
        self.rows = rows
        self.batch = {"responses": torch.stack([r.batch["responses"] for r in rows])}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Item:
        return self.rows[i]


def verl_dapo_manager() -> type:
    """verl's ``DAPORewardManager`` class as published, its base class's reward-model path stubbed (no RM here)."""
    source = (DATA / "dapo_reward_manager_1dda039b.py").read_text()
    tree = ast.parse(source)
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DAPORewardManager"]
    node.decorator_list = []

    class AbstractRewardManager:
        def _extract_reward_from_rm_scores(self, data, return_dict=False):
            return None

    namespace = {"torch": torch, "defaultdict": defaultdict, "AbstractRewardManager": AbstractRewardManager}
    namespace["default_compute_score"] = default_compute_score
    exec(compile(ast.Module(body=[node], type_ignores=[]), "dapo.py", "exec"), namespace)
    return namespace["DAPORewardManager"]


SOURCES = {  # data source -> (question, a right and a wrong response ending) in each reward's answer format
    "openai/gsm8k": ("What is {a} plus {b}?", "#### {c}", "#### {w}"),
    "DigitalLearningGmbH/MATH-lighteval": ("What is {a} plus {b}?", "\\boxed{{{c}}}", "\\boxed{{{w}}}"),
    "math_dapo": ("What is {a} plus {b}?", "Answer: {c}", "Answer: {w}"),
}


def seeded_rows(tokenizer, source: str, seed: int, max_len: int) -> list[tuple[list[int], list[int], str]]:
    """(prompt ids, response ids, ground truth): right and wrong answers after filler of random lengths (0 to the
    response limit), so responses fall before, in and at the end of the overlong buffer."""
    rng = random.Random(seed)
    question, right, wrong = SOURCES[source]
    rows = []
    for _ in range(24):
        a, b = rng.randrange(30), rng.randrange(30)
        answer = (right if rng.random() < 0.5 else wrong).format(c=a + b, w=a + b + 1)
        tail = tokenizer(" " + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        filler = [rng.choice(tokenizer(" plus 12", add_special_tokens=False)["input_ids"]) for _ in range(max_len)]
        length = rng.randint(len(tail), max_len)
        response = filler[: length - len(tail)] + tail
        prompt = tokenizer(question.format(a=a, b=b), add_special_tokens=False)["input_ids"]
        rows.append((prompt, response, str(a + b)))
    return rows


def as_batch(tokenizer, rows, source: str, max_len: int) -> RolloutBatch:
    prompts, prompt_mask = left_pad([p for p, _, _ in rows], tokenizer.pad_token_id)
    responses = torch.full((len(rows), max_len), tokenizer.pad_token_id)
    response_mask = torch.zeros((len(rows), max_len), dtype=torch.long)
    for i, (_, response, _) in enumerate(rows):
        responses[i, : len(response)] = torch.tensor(response)
        response_mask[i, : len(response)] = 1
    return RolloutBatch(
        input_ids=torch.cat([prompts, responses], 1),
        attention_mask=torch.cat([prompt_mask, response_mask], 1),
        response_mask=response_mask,
        prompt_length=prompts.shape[1],
        uid=list(range(len(rows))),
        data_source=[source] * len(rows),
        ground_truth=[truth for _, _, truth in rows],
    )


def as_proto(batch: RolloutBatch) -> Proto:
    items = []
    for i in range(batch.size):
        items.append(
            Item(
                {
                    "prompts": batch.input_ids[i, : batch.prompt_length],
                    "responses": batch.responses[i],
                    "attention_mask": batch.attention_mask[i],
                },
                {
                    "reward_model": {"ground_truth": batch.ground_truth[i]},
                    "data_source": batch.data_source[i],
                    "extra_info": {},
                },
            )
        )
    return Proto(items)


class Buffer(dict):
    """verl's ``overlong_buffer_cfg`` (an OmegaConf node, read by attribute)."""

    __getattr__ = dict.__getitem__


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize(("length", "factor", "log"), [(8, 1.0, True), (20, 0.5, False)])
def test_the_overlong_penalty_equals_verls_dapo_reward_manager(tokenizer, source, length, factor, log):
    max_len = 24
    batch = as_batch(tokenizer, seeded_rows(tokenizer, source, 7, max_len), source, max_len)
    buffer = OverlongBufferConfig(enable=True, len=length, penalty_factor=factor, max_resp_len=max_len, log=log)
    ours = RewardWorker(RewardFunction(), tokenizer, dapo=(buffer, max_len)).score(batch)
    cfg = Buffer(enable=True, len=length, penalty_factor=factor, log=log)
    verl = verl_dapo_manager()(tokenizer, num_examine=0, max_resp_len=max_len, overlong_buffer_cfg=cfg)
    with torch.no_grad():
        theirs = verl(as_proto(batch), return_dict=True)
    assert torch.equal(ours.token_level, theirs["reward_tensor"])
    penalised = sum(1 for r in theirs["reward_tensor"].sum(-1) if r not in (0.0, 1.0, -1.0))
    assert penalised >= 4, "some responses must fall inside the buffer (else the test proves little)"
    numbers = {k: v for k, v in theirs["reward_extra_info"].items() if k != "pred"}  # pred: an answer, not a number
    assert ours.per_response == {k: [float(x) for x in v] for k, v in numbers.items()}


def test_without_the_buffer_dapo_scores_as_naive_and_records_a_number_reward_as_acc(tokenizer):
    batch = as_batch(tokenizer, seeded_rows(tokenizer, "openai/gsm8k", 3, 16), "openai/gsm8k", 16)
    naive = RewardWorker(RewardFunction(), tokenizer).score(batch)
    dapo = RewardWorker(RewardFunction(), tokenizer, dapo=(OverlongBufferConfig(), 16)).score(batch)
    assert torch.equal(naive.token_level, dapo.token_level) and naive.per_response == {}
    assert dapo.per_response["acc"] == naive.token_level.sum(-1).tolist()


# ----------------------------------------------------------------------------------------- dynamic sampling


class RecipeBatch:
    """The parts of verl's ``DataProto`` the DAPO recipe's group filter reads: ``non_tensor_batch``, ``batch``,
    selection by a list of rows, and ``DataProto.concat``."""

    def __init__(self, non_tensor: dict[str, np.ndarray], tensors: dict[str, torch.Tensor]) -> None:
        self.non_tensor_batch, self.batch = non_tensor, tensors

    def __getitem__(self, rows: list[int]) -> RecipeBatch:
        return RecipeBatch(
            {k: v[rows] for k, v in self.non_tensor_batch.items()}, {k: v[rows] for k, v in self.batch.items()}
        )

    @staticmethod
    def concat(parts: list[RecipeBatch]) -> RecipeBatch:
        return RecipeBatch(
            {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch},
            {k: torch.cat([p.batch[k] for p in parts]) for k in parts[0].batch},
        )


def recipe_filter() -> str:
    """The DAPO recipe's filtering code, as published: the ``else`` branch of ``if not
    self.config.algorithm.filter_groups.enable`` in ``RayDAPOTrainer.fit``, up to the count it keeps."""
    source = (DATA / "dapo_ray_trainer_recipe.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and "filter_groups.enable" in ast.unparse(node.test):
            body = node.orelse[: [ast.unparse(s).startswith("prompt_bsz") for s in node.orelse].index(True)]
            return ast.unparse(ast.Module(body=body, type_ignores=[]))
    raise AssertionError("the recipe has no filter_groups branch")


def run_recipe(metric: str, uids: list[str], values: list[float], scores: torch.Tensor) -> tuple[list[str], int]:
    class Config:
        class algorithm:
            class filter_groups:
                pass

    Config.algorithm.filter_groups.metric = metric
    me = type("Trainer", (), {"config": Config})()
    new_batch = RecipeBatch(
        {"uid": np.array(uids, dtype=object), metric: np.array(values)},
        {"token_level_scores": scores, "token_level_rewards": scores},
    )
    namespace = {"self": me, "new_batch": new_batch, "batch": None, "num_prompt_in_batch": 0, "np": np}
    namespace |= {"defaultdict": defaultdict, "DataProto": RecipeBatch}
    exec(recipe_filter(), namespace)
    return list(namespace["batch"].non_tensor_batch["uid"]), namespace["num_prompt_in_batch"]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("metric", ["acc", "seq_reward"])
def test_the_groups_kept_equal_the_dapo_recipes(seed, metric):
    """Groups of 4 with accuracies mostly all-same (easy and impossible prompts) and some mixed; a group of one."""
    rng = random.Random(seed)
    uids, values = [], []
    for g in range(16):
        kind = rng.choice(["easy", "hard", "mixed", "mixed"])
        size = 1 if g == 7 else 4
        for _ in range(size):
            uids.append(f"u{g}")
            values.append({"easy": 1.0, "hard": 0.0, "mixed": float(rng.random() < 0.5)}[kind])
    order = list(range(len(uids)))
    rng.shuffle(order)  # responses of a group need not be adjacent for the recipe
    uids, values = [uids[i] for i in order], [values[i] for i in order]
    scores = torch.zeros(len(uids), 6)
    scores[:, 3] = torch.tensor(values)
    kept_uids, kept_count = run_recipe(metric, uids, values, scores)
    ours = groups_with_variance(uids, values if metric == "acc" else scores.sum(-1).tolist())
    assert kept_count == len(ours) and [u for u in uids if u in ours] == kept_uids
    assert "u7" in ours and 0 < len(ours) < 16


# ----------------------------------------------------------------------------------------- assembly across ranks


def fake_batch(uids: list[int], n: int, width: int, tag: float) -> RolloutBatch:
    """Rows of ``len(uids)`` groups of ``n`` responses ``width`` tokens long (values identify each row)."""
    rows = len(uids) * n
    ids = torch.arange(rows * (2 + width)).reshape(rows, 2 + width) + int(tag * 1000)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(rows, width, dtype=torch.long),
        prompt_length=2,
        uid=[u for u in uids for _ in range(n)],
        data_source=["s"] * rows,
        ground_truth=["0"] * rows,
        n=n,
        token_level_scores=torch.full((rows, width), tag),
        extras={"reward_extra": {"acc": [tag] * rows}},
    )


class Group:
    """``world`` threads as ranks, ``gather`` as ``all_gather_object``: every rank's value, in rank order."""

    def __init__(self, world: int) -> None:
        self.world, self.barrier, self.values = world, threading.Barrier(world), [None] * world

    def gather(self, rank: int):
        def gather(value):
            self.values[rank] = value
            self.barrier.wait()
            out = list(self.values)
            self.barrier.wait()
            return out

        return gather


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_gets_its_share_of_the_first_kept_groups_in_verls_order(world):
    """Rounds kept 3, then 1, then 2 groups per rank (of different response widths); 8 groups are needed: the first
    8 in (round, rank, position) order, split evenly, equal what one controller concatenating all ranks would pick."""
    n, need = 2, 8
    kept = {(j, r): [100 * j + 10 * r + k for k in range(c)] for j, c in enumerate([3, 1, 2]) for r in range(world)}
    widths = [5, 7, 4]
    group, results = Group(world), {}

    def rank_main(rank):
        rounds = Rounds()
        for j in range(3):
            uids = kept[(j, rank)]
            rounds.kept.append(Round(fake_batch(uids, n, widths[j], j + rank / 10), len(uids)))
        results[rank] = assemble(rounds, need, rank, world, group.gather(rank))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    order = [u for j in range(3) for r in range(world) for u in kept[(j, r)]][:need]
    share = need // world
    for rank in range(world):
        batch, surplus = results[rank]
        assert batch.uid[::n] == order[rank * share : (rank + 1) * share]
        assert surplus == sum(len(v) for v in kept.values()) - need
        widest = max(widths[uid // 100] for uid in batch.uid)  # padded to the widest round among its groups
        assert batch.input_ids.shape[1] == 2 + widest and len(batch.extras["reward_extra"]["acc"]) == batch.size
        for row, uid in enumerate(batch.uid):  # each row's values came with it, padded to the widest round
            j, r = uid // 100, (uid % 100) // 10
            assert batch.token_level_scores[row, 0] == pytest.approx(j + r / 10)
            assert batch.response_mask[row].sum() == widths[j]


def test_a_rounds_groups_without_variance_are_dropped_and_counted_by_their_shared_value():
    batch = fake_batch([1, 2, 3], 2, 3, 0.0)
    rounds = Rounds()
    per_response = {"acc": [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]}
    rounds.keep(batch, FilterGroupsConfig(enable=True, metric="acc"), per_response, lambda value: [value], 3)
    assert rounds.groups == 1 and rounds.dropped == 2 and rounds.dropped_by_value == {1.0: 1, 0.0: 1}
    assert rounds.kept[0].batch.uid == [2, 2]
    with pytest.raises(ValueError, match=r"metric='score': the reward did not give 'score' for every response"):
        rounds.keep(batch, FilterGroupsConfig(enable=True, metric="score"), per_response, lambda value: [value], 3)


def test_without_the_filter_a_round_is_kept_whole_with_no_exchange_between_ranks():
    """The usual step: no collective here (one inside the reward's phase made every rank wait for the slowest there,
    and hid a slow rank's reward from the straggler rule: tests/rlprof/test_report_rules.py)."""

    def no_exchange(value):
        raise AssertionError("nothing is gathered without the filter")

    batch = fake_batch([1, 2, 3], 2, 3, 0.0)
    rounds = Rounds()
    rounds.keep(batch, FilterGroupsConfig(enable=False), {}, no_exchange, 6)  # 3 here, 3 on the other rank
    assert rounds.groups == 6 and rounds.dropped == 0 and rounds.kept[0].batch is batch


# ----------------------------------------------------------------------------------------- the learning rate


def verl_schedules() -> dict[str, Any]:
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LambdaLR

    names = ("get_cosine_schedule_with_warmup", "get_constant_schedule_with_warmup")
    return verl_functions(
        DATA / "torch_functional_1dda039b.py", names, {"math": math, "LambdaLR": LambdaLR, "Optimizer": Optimizer}
    )


@pytest.mark.parametrize(
    "optim",
    [
        OptimConfig(lr=1e-3, lr_warmup_steps=10),
        OptimConfig(lr=1e-3, lr_warmup_steps_ratio=0.25),
        OptimConfig(lr=1e-3, lr_warmup_steps=-1),  # no warm-up
        OptimConfig(lr=2e-4, lr_warmup_steps=5, lr_scheduler_type="cosine", min_lr_ratio=0.1),
        OptimConfig(lr=2e-4, lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", num_cycles=1.5),
        OptimConfig(lr=2e-4, lr_warmup_steps=3, lr_scheduler_type="cosine", zero_indexed_step=False),
    ],
)
def test_the_learning_rate_of_every_update_equals_verls_scheduler(optim):
    """verl's FSDP engine builds the scheduler (warm-up steps: lr_warmup_steps, else int(ratio * total)) and steps
    it once per update, after it: the update's learning rate is the optimizer's before that step."""
    total = 40
    verl = verl_schedules()
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=optim.lr)
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total)
    if optim.lr_scheduler_type == "constant":
        scheduler = verl["get_constant_schedule_with_warmup"](optimizer=optimizer, num_warmup_steps=warmup)
    else:
        scheduler = verl["get_cosine_schedule_with_warmup"](
            optimizer=optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total,
            min_lr_ratio=optim.min_lr_ratio,
            num_cycles=optim.num_cycles,
            zero_indexed_step=optim.zero_indexed_step,
        )
    schedule = LRSchedule(optim, total)
    for update in range(1, total + 1):
        assert schedule.lr(update) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-18), update
        optimizer.step()
        scheduler.step()
    assert schedule.warmup_steps == warmup


# ----------------------------------------------------------------------------------------- validation, the model


def test_validation_samples_only_with_do_sample_as_verl():
    greedy = validation_sampling(ValKwargs(temperature=1.0, top_p=0.7, top_k=5, n=2), 16, seed=1, step=0)
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.n) == (0.0, 1.0, -1, 2)
    kwargs = ValKwargs(do_sample=True, temperature=0.8, top_p=0.7, top_k=5, n=3)
    sampled = validation_sampling(kwargs, 16, seed=1, step=0)
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.n) == (0.8, 0.7, 5, 3)
    seeds = {validation_sampling(kwargs, 16, seed, step).seed for seed in (1, 2) for step in (0, 5)}
    assert len(seeds) == 4  # each validation of each run draws afresh


@pytest.mark.slow  # set-up heavy: out of the quick loop
def test_model_config_overrides_reach_the_loaded_model_and_unknown_keys_are_named(tmp_path):
    model = create_tiny_model(tmp_path / "model", sft_steps=0)
    overrides = {"max_position_embeddings": 1024, "attention_dropout": 0.25, "embd_pdrop": 0.0}
    config, unknown = overridden_config(model, overrides)
    assert (config.max_position_embeddings, config.attention_dropout, unknown) == (1024, 0.25, ["embd_pdrop"])
    loaded = load_causal_lm(model, overrides=overrides)
    assert loaded.config.max_position_embeddings == 1024 and loaded.config.attention_dropout == 0.25
    assert load_causal_lm(model).config.max_position_embeddings != 1024


# ----------------------------------------------------------------------------------------- the config checks


def test_the_dapo_settings_that_cannot_run_are_named_together():
    cfg = load_trainer_config(
        [
            "--config-name=demo",
            "reward_model.overlong_buffer.enable=true",  # naive manager, no length
            "algorithm.filter_groups.enable=true",  # no metric
            "data.gen_batch_size=3",
        ]
    )
    with pytest.raises(Exception) as caught:
        validate(cfg, world_size=2)
    message = str(caught.value)
    for fragment in (
        "reward_model.overlong_buffer.enable=True: the overlong penalty is the DAPO reward manager's; set "
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.len=0: must be > 0 when the buffer is enabled",
        "algorithm.filter_groups.metric=None: dynamic sampling needs",
        "data.gen_batch_size=3: must be a multiple of the number of ranks (2)",
    ):
        assert fragment in message, (fragment, message)
    assert "\n" not in message


def test_verls_new_layout_of_the_dapo_reward_keys_lands_on_ours():
    cfg = load_trainer_config(
        [
            "--config-name=demo",
            "reward.reward_manager.name=dapo",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=6",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward.reward_kwargs.overlong_buffer_cfg.log=True",
            "+reward.reward_kwargs.max_resp_len=12",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "critic.strategy=fsdp2",
            "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
        ]
    )
    buffer = cfg.reward_model.overlong_buffer
    assert cfg.reward_model.reward_manager == "dapo"
    assert (buffer.enable, buffer.len, buffer.penalty_factor, buffer.log, buffer.max_resp_len) == (
        True,
        6,
        0.5,
        True,
        12,
    )
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert cfg.actor_rollout_ref.model.override_config == {"max_position_embeddings": 32768}


# ----------------------------------------------------------------------------------------- a run


MOSTLY_SOLVED = textwrap.dedent(
    """
    import zlib


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # a prompt whose answer is not a multiple of 3 is always solved (every response right: a group without
        # variance); the others' responses are right or wrong by their text
        solved = int(ground_truth) % 3 != 0 or zlib.crc32(solution_str.encode()) % 2 == 0
        return {"score": 1.0 if solved else 0.0, "acc": solved}
    """
)
DYNAMIC = (
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    "data.gen_batch_size=8",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.save_freq=1",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
)


def dapo_run(folder: Path, reward: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    command = trainer_command(folder, *DYNAMIC, f"custom_reward_function.path={reward}", *overrides)
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())
    assert result.returncode == 0, result.stderr[-4000:]
    return result, [r for r in read_jsonl(folder / "logs" / "metrics.jsonl") if r["step"] > 0]


@pytest.mark.long  # CI time: in the test command's long runs
def test_dynamic_sampling_drops_solved_groups_says_so_and_the_report_shows_the_extra_generation(tmp_path, capsys):
    """Most prompts are solved by every response (those whose answer is not a multiple of 3): each step needs several
    rounds of 8 prompts to keep 8 groups. The log and the metrics say how many groups were dropped and how many
    rounds a step took; the report's step breakdown has the extra generation as its own phase; a run resumed after
    step 2 takes step 3's prompts from where the stream stopped (the same groups as the run that did not stop); one
    round allowed, the run stops with one line saying what it kept."""
    reward = tmp_path / "mostly_solved.py"
    reward.write_text(MOSTLY_SOLVED)
    result, rows = dapo_run(tmp_path / "whole", reward, "trainer.total_training_steps=3")
    for row in rows:
        rounds, dropped = row["train/num_gen_batches"], row["training/filter_groups/evicted_samples"]
        counts = {
            key.rsplit("/", 1)[1]: value
            for key, value in row.items()
            if key.startswith("training/filter_groups/filtered_reward_counts/")
        }  # the dropped groups by their one reward: solved (1), or a multiple of 3 all answered wrong (0)
        assert rounds >= 2 and dropped >= 1 and sum(counts.values()) == dropped and counts["1"] >= 1
        assert set(counts) <= {"0", "1"}
        assert row["timing_s/gen_refill"] > 0 and row["response_length/mean"] > 0
        assert f"step {row['step']}: {rounds:g} generation rounds for 8 prompt groups; {dropped:g} of " in result.stderr
    assert [row["actor/lr"] for row in rows] == pytest.approx([0.0, 2.5e-4, 5e-4])  # the warm-up over 2 updates
    assert main(["report", str(tmp_path / "whole" / "logs"), "--format", "json"]) == 0
    phases = {p["phase"]: p for p in json.loads(capsys.readouterr().out)["breakdown"]["phases"]}
    assert phases["gen_refill"]["group"] == "rollout" and phases["gen_refill"]["median_s"] > 0
    dapo_run(tmp_path / "stopped", reward, "trainer.total_training_steps=2")
    again, resumed = dapo_run(tmp_path / "stopped", reward, "trainer.total_training_steps=3")
    assert "checkpoint: resumed from" in again.stderr and [r["step"] for r in resumed] == [1, 2, 3]
    keys = ("training/batch_fingerprint", "train/num_gen_batches", "critic/score/mean", "actor/lr")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in rows]
    command = trainer_command(tmp_path / "limited", *DYNAMIC, f"custom_reward_function.path={reward}")
    command.append("algorithm.filter_groups.max_num_gen_batches=1")
    limited = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=subprocess_env())
    (line,) = [line for line in limited.stderr.splitlines() if line.startswith("error on rank 0:")]
    assert limited.returncode == 1 and "Traceback" not in limited.stderr, limited.stderr[-3000:]
    assert "algorithm.filter_groups.max_num_gen_batches=1: 1 generation rounds kept " in line
    assert " of the 8 prompt groups the step needs (" in line and "had no variance in acc)" in line
