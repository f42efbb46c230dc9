"""infinity's benchmarks, one harness for all of them.

Each benchmark is a module run as ``python -m benchmarks.<name>`` from the repository root; it
builds its contenders from the shared parts and hands them to the harness:

- ``_flags``: the one spelling of each flag (``--steps``, ``--warmup``, ``--seq-len``,
  ``--micro-batch``, ``--nvme-path``, ``--only``, ``--smoke``, ``--out``, ``--rounds``,
  ``--budget``, ``--timeout``), the one size parser, the one host peak-memory reader;
- ``_models``: the one GPT-2 builder (shapes ``tiny``, ``124m``, ``1.5b``) and the one batch maker;
- ``_trainers``: one training step per contender (plain PyTorch, infinity, DeepSpeed, FSDP2);
- ``_harness``: each contender in a process of its own under a time limit, interleaved rounds,
  medians with min and max, one JSON record schema (``RESULT_FIELDS``, ``RATIO_FIELDS``).

Benchmarks: ``peers`` (the GPU head-to-head: plain PyTorch, infinity, DeepSpeed, FSDP2). Every
benchmark has a ``--smoke`` size that runs on a CPU in seconds; ``tests/test_benchmarks_smoke.py``
runs it.
"""
