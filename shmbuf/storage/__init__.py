"""Learner-side storage on shmbuf: PPO rollout storage with GAE and minibatches, the [num_envs, T+1]
rollout buffer, and a replay buffer in shared memory.

numpy only; torch stays optional (``to_torch`` uses ``torch.from_numpy``: zero-copy on CPU). Nothing
here imports ``workers``: a Collector batch is read through what it has (``data``, ``fill``).
See docs/storage.md for how each class maps to the systems it learns from.
"""
