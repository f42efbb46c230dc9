"""Crash-safe sharded checkpoints of every state on every tier (Note [checkpoint layout] in
_format.py, Note [crash-safe commit] in _save.py), loadable at another world size and
placement, and read without a process group by ``infinity.export``."""
from ._format import CheckpointReader
from ._load import load_checkpoint
from ._save import save_checkpoint

__all__ = ["CheckpointReader", "load_checkpoint", "save_checkpoint"]
