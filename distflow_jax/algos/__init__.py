"""The pure maths of the RL algorithms: advantage estimators, losses, KL.

``advantages``: GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++ (+ baseline).
``losses``: PPO / DAPO / GSPO policy loss, KL and entropy terms, value loss,
  all returning sums and denominators (exact across micro-batches and hosts).
``kl``: per-token KL estimators (k1, k2, k3), reward penalty, adaptive
  coefficient.
"""
