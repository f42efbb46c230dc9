"""The ZeRO layer: partitioned parameters and the engine that trains them. ``Init`` and the
streamed pretrained loader, fetch units and their hold ledger, the phase and step gate, the
prefetcher, the reduce-scatter, the optimizer over the stores of the offload layer, loss
scaling, parameter groups, tiling, activation offload, ``GatheredParameters`` and
``initialize``, which builds it all."""
