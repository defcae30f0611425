"""teamrl.models: builders of the embedded models that need the rollout's workflows.

``text`` builds ``embedded-text`` (a BPE tokenizer and a small Qwen2 warm-started on demonstrations
rendered by the rollout's episode executor), so it sits above both services, beside the ``teamrl``
command; the character model's builder, which needs only the addition task, is
``teamrl.learner.modelbuild``.
"""
