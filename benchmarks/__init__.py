"""infinity's benchmarks, one harness for all of them.

Each benchmark is a module run as ``python -m benchmarks.<name>`` from the repository root; it
builds its contenders from the shared parts and hands them to the harness:

- ``_flags``: the one spelling of each flag (``--steps``, ``--warmup``, ``--seq-len``,
  ``--micro-batch``, ``--nvme-path``, ``--only``, ``--smoke``, ``--out``, ``--rounds``,
  ``--budget``, ``--timeout``), the one size parser, the one host peak-memory reader;
- ``_models``: the one GPT-2 builder (named shapes ``tiny``, ``124m``, ``1.3b``, ``1.5b``, or
  any ``Shape``) and the one batch maker; ``_blocks``: one GPT-style block of plain torch modules;
- ``_trainers``: one training step per contender (plain PyTorch, infinity, DeepSpeed, FSDP2) and
  the one ``infinity_config``;
- ``_disk``: the free-disk check and the bandwidth over a working set of files;
- ``_harness``: each contender in a process of its own under a time limit, or several side by
  side in one (Note [contenders side by side] in _harness.py), rotated rounds, medians with min and max, one
  JSON record schema (``RESULT_FIELDS``, ``RATIO_FIELDS``, ``TRANSCRIBED_FIELDS``), the closing
  table and the ratios (``finish``).

The benchmarks: ``peers`` (the head-to-head: plain PyTorch, infinity, DeepSpeed, FSDP2),
``step_profile``, ``prefetch``, ``host_memory``, ``large_model``, ``disk_mix``, ``aio``,
``cpu_adam``, ``checksums``, ``checkpoint``, ``compressed_states``, ``load``, ``param_bytes``,
``fetch_units``, ``tiling``, ``activation_offload``, ``device_primitives``; ``report`` writes
docs/benchmarks.md (and its plots, ``_plots``) and docs/measured.md (``_measured``) from
benchmarks/records/. Every benchmark has a ``--smoke`` size that runs on a CPU in seconds;
``tests/integration/test_benchmarks_smoke.py`` runs them.
"""
