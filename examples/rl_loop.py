"""A hand-written RL loop (no trainer) instrumented with rlprof: rollout, reward, ref, critic and actor.

A tiny autoregressive policy learns to emit a target token; every phase is a decorated function or a
``profile_range``, and ``rlprof.step(n)`` marks each step. Choose the tool by OmegaConf override::

    python examples/rl_loop.py global_profiler.tool=torch global_profiler.steps=[2,3]
    python examples/rl_loop.py global_profiler.tool=torch_memory
    nsys profile -t nvtx,osrt --sample=none --cpuctxsw=none -o rl python examples/rl_loop.py global_profiler.tool=nsys
    torchrun --nproc_per_node 2 examples/rl_loop.py global_profiler.tool=torch role_profiler.all_ranks=true

``role_profiler`` is shared by every role block below (OmegaConf interpolation); override one role with e.g.
``actor.profiler.ranks=[1]``. ``--config FILE.yaml`` replaces the profiler settings (``global_profiler`` and the
role blocks) with the file's, e.g. the seed's ``actor_rollout_ref.actor.profiler`` block alone::

    python examples/rl_loop.py --config profile.yaml global_profiler.steps=[2]
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

# torch.optim imports torch._dynamo on first use; imported after init_process_group it keeps the group (and gloo's
# worker threads) alive past destroy_process_group, and a worker still freeing the last collective's tensors can then
# abort the interpreter's exit ("terminate called without an active exception"). So it is imported first.
import torch._dynamo
import torch.nn.functional as F
from omegaconf import OmegaConf

import rlprof

DEFAULTS = """
global_profiler:
  tool: null
  steps: null
  profile_continuous_steps: false
  save_path: outputs/example_profile
role_profiler: {enable: true, all_ranks: false, ranks: [0]}
rollout: {profiler: "${role_profiler}"}
reward: {profiler: "${role_profiler}"}
ref: {profiler: "${role_profiler}"}
critic: {profiler: "${role_profiler}"}
actor: {profiler: "${role_profiler}"}
loop:
  steps: 5            # training steps, numbered from 1
  batch_size: 16      # prompts per step
  response_length: 4  # tokens sampled per response
  vocab_size: 32
  hidden: 64
  target_token: 7     # reward = fraction of response tokens equal to this
  seed: 0
"""


class TinyPolicy(torch.nn.Module):
    """A GRU language model over a small vocabulary; ``value_head`` serves as the critic."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden)
        self.rnn = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.lm_head = torch.nn.Linear(hidden, vocab_size)
        self.value_head = torch.nn.Linear(hidden, 1)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        states, _ = self.rnn(self.embed(tokens))
        return self.lm_head(states), self.value_head(states).squeeze(-1)


@rlprof.profiled(role="rollout", name="generate")
def generate(policy: TinyPolicy, prompts: torch.Tensor, length: int) -> torch.Tensor:
    tokens = prompts
    with torch.no_grad():
        for _ in range(length):
            logits, _ = policy(tokens)
            next_token = torch.distributions.Categorical(logits=logits[:, -1]).sample()
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
    return tokens


@rlprof.profiled(role="reward", name="score")
def score(responses: torch.Tensor, target: int) -> torch.Tensor:
    return (responses == target).float().mean(dim=1)


def response_log_probs(policy: TinyPolicy, tokens: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits, values = policy(tokens[:, :-1])
    log_probs = torch.gather(F.log_softmax(logits, -1), 2, tokens[:, 1:, None]).squeeze(-1)
    return log_probs[:, -length:], values[:, -length:]


@rlprof.profiled(role="ref", name="compute_ref_log_prob")
def ref_log_probs(ref: TinyPolicy, tokens: torch.Tensor, length: int) -> torch.Tensor:
    with torch.no_grad():
        return response_log_probs(ref, tokens, length)[0]


@rlprof.profiled(role="critic", name="compute_values")
def compute_values(policy: TinyPolicy, tokens: torch.Tensor, length: int) -> torch.Tensor:
    with torch.no_grad():
        return response_log_probs(policy, tokens, length)[1]


@rlprof.profiled(role="actor", name="update_policy")
def update(
    policy: TinyPolicy,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    length: int,
    rewards: torch.Tensor,
    values: torch.Tensor,
    ref_lp: torch.Tensor,
) -> dict[str, float]:
    advantages = (rewards[:, None] - values).detach()
    log_probs, new_values = response_log_probs(policy, tokens, length)
    kl = (log_probs - ref_lp).mean()
    pg_loss = -(advantages * log_probs).mean()
    with rlprof.profile_range("value_loss", role="critic"):
        vf_loss = F.mse_loss(new_values, rewards[:, None].expand_as(new_values))
    loss = pg_loss + 0.5 * vf_loss + 0.01 * kl
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"pg_loss": pg_loss.item(), "vf_loss": vf_loss.item(), "kl": kl.item()}


ROLE_KEYS = ("role_profiler", "rollout", "reward", "ref", "critic", "actor")


def load(argv: list[str]) -> Any:
    """DEFAULTS, then ``--config FILE`` (its profiler settings replace the default role blocks), then overrides."""
    base = OmegaConf.create(DEFAULTS)
    if argv[:1] == ["--config"]:
        base = OmegaConf.merge(
            OmegaConf.masked_copy(base, [k for k in base if k not in ROLE_KEYS]), OmegaConf.load(argv[1])
        )
        argv = argv[2:]
    return OmegaConf.merge(base, OmegaConf.from_dotlist(argv))


def main(argv: list[str]) -> None:
    cfg = load(argv)
    loop = cfg.loop
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:  # launched by torchrun: data-parallel ranks that average their rewards for the log line
        torch.distributed.init_process_group("gloo")
    rlprof.init(cfg)
    torch.manual_seed(loop.seed)
    policy = TinyPolicy(loop.vocab_size, loop.hidden)
    ref = TinyPolicy(loop.vocab_size, loop.hidden)
    ref.load_state_dict(policy.state_dict())
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for step in range(1, loop.steps + 1):
        with rlprof.step(step):
            prompts = torch.randint(0, loop.vocab_size, (loop.batch_size, 2))
            tokens = generate(policy, prompts, loop.response_length)
            rewards = score(tokens[:, -loop.response_length :], loop.target_token)
            ref_lp = ref_log_probs(ref, tokens, loop.response_length)
            values = compute_values(policy, tokens, loop.response_length)
            stats = update(policy, optimizer, tokens, loop.response_length, rewards, values, ref_lp)
            mean_reward = rewards.mean()
            if distributed:
                torch.distributed.all_reduce(mean_reward)
                mean_reward /= torch.distributed.get_world_size()
        print(f"step {step}: reward={mean_reward:.3f} pg_loss={stats['pg_loss']:.4f} kl={stats['kl']:.4f}")
    rlprof.shutdown()
    if distributed:
        torch.distributed.barrier()  # gloo can abort at teardown while a peer still sends; settle first
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
