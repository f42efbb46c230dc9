"""The ``infinity`` logger: rank-aware, quiet on ranks other than 0 unless asked.

Library code never prints; it logs here. ``INFINITY_LOG_LEVEL`` sets the level (default
INFO) and ``INFINITY_LOG_ALL_RANKS=1`` lets every rank speak.
"""
import logging
import os

logger = logging.getLogger("infinity")


def _rank() -> int:
    try:  # late: a record may be logged while torch is missing, half-imported or torn down at exit
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # torch missing or half-initialized: fall back to the env
        pass
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    """Tags each record with its rank and drops records of non-zero ranks by default."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        setattr(record, "rank", rank)  # a record's extra field (read by the format string)
        if getattr(record, "all_ranks", False) or os.environ.get("INFINITY_LOG_ALL_RANKS") == "1":
            return True
        return rank == 0


def _configure() -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[infinity rank %(rank)s] %(levelname)s %(message)s"))
    handler.addFilter(_RankFilter())
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("INFINITY_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


_configure()
