"""teamrl.rollout: Flex-MG multi-agent episodes on vLLM with per-agent LoRA adapters.

``workflow.py`` defines agents, the dependency function D and agent-to-model mappings (pure Python);
``engine.py`` wraps vLLM's async engine; ``service.py`` is the rollout process.
"""
