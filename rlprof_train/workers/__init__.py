"""The PPO roles: actor, critic, reference and reward, each behind a small class; rollout backends in rollout/."""
