"""teamrl.protocol: the wire between rollouts, the replay buffer and learners (no torch, no vllm)."""
