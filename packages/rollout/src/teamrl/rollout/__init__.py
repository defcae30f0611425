"""teamrl.rollout: Flex-MG multi-agent episodes on vLLM with per-agent LoRA adapters.

``workflow.py`` defines a workflow: agents, the dependency function D and agent-to-model mappings,
built from the parts in ``spec.py``, checked by ``validation.py``, whose agents read each other
through ``views.py``; ``executor.py`` runs episodes (``run_episode``; pure Python, no vLLM import);
the rewards that score them are ``teamrl.rewards.outcome``; ``workflows/`` holds the built-in
workflows (``teamrl.rollout.workflows.load(name)``) and their task data; ``tools.py`` the Python and
BM25 tools; ``engine.py`` wraps vLLM's async engine; ``service.py`` is the rollout process
(``config.py`` its ``[rollout]`` table, ``sender.py`` its sender thread, ``probe_server.py`` its
probes, ``cli.py`` the ``teamrl rollout`` command). Prompt tokenizers live in
``teamrl.rewards.tokenizer`` (the learner's judge and the model builders use them too) and are
re-exported here.
"""

from teamrl.rewards.base import ActView, EpisodeRewards
from teamrl.rewards.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    tokenizer_for,
)
from teamrl.rollout.executor import RouteState, run_episode
from teamrl.rollout.spec import AgentSpec, GraphSpec, WorkflowError
from teamrl.rollout.tools import BM25Index, Document, PythonTool, SearchTool, Tool, parse_tool_call
from teamrl.rollout.workflow import Workflow
from teamrl.rollout.workflows import load_workflow

__all__ = [
    "ActView",
    "AgentSpec",
    "BM25Index",
    "ByteTokenizer",
    "CharTokenizer",
    "Document",
    "EpisodeRewards",
    "GraphSpec",
    "HFTokenizer",
    "PythonTool",
    "RouteState",
    "SearchTool",
    "Tokenizer",
    "TokenizerError",
    "Tool",
    "Workflow",
    "WorkflowError",
    "load_workflow",
    "parse_tool_call",
    "run_episode",
    "tokenizer_for",
]
