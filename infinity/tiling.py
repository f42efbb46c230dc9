"""Memory-centric tiling of large linear and embedding layers (paper 002 §5.1.3): the public
face. The implementation and its Notes are in ``infinity/_zero/_tiling.py``."""
from ._zero._tiling import (
    TiledEmbedding,
    TiledLinear,
    check_working_memory,
    embedding_splits,
    linear_splits,
    split_bounds,
    tile_model,
    tile_params_to_fit,
    working_memory_bytes,
)

__all__ = ["TiledEmbedding", "TiledLinear", "check_working_memory", "embedding_splits", "linear_splits", "split_bounds",
           "tile_model", "tile_params_to_fit", "working_memory_bytes"]
