"""The offload layer: where states live and how they move between host memory and NVMe. The
memory plan and its preflight, the placement of each state on a tier, the parameter store, the
optimizer stores (host memory and NVMe, with compressed moments) and the swap files. Built on
the runtime layer; knows nothing of modules, units or the engine."""
