"""The runtime layer: what every other layer stands on. The accelerator interface (device,
streams, pinned memory), collectives, logging, telemetry, the tier names, buffer recycling and
the step schedule. Beside it, and in the same layer, the public ``errors``, ``config``, ``aio``
and ``optim`` packages. Imports nothing of the layers above (tests/unit/test_layering.py)."""
