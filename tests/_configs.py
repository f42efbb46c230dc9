"""The one builder of test configs: every test file states only what its tests vary."""


def zero_config(stage, *, param=None, optim=None, nvme=None, dtype="fp32", precision=None, lr=2e-3, weight_decay=None,
                adam=None, clip=0.0, accumulation=None, bucket=None, chunk=None, prefetch=None, optim_extra=None,
                **zero_extra) -> dict:
    """A config dict: ZeRO ``stage``; the parameter tier ``param`` (stage 3) and the optimizer
    tier ``optim`` (both with ``nvme`` as their nvme_path); ``prefetch`` the prefetch section;
    ``bucket`` the reduce bucket, ``chunk`` the optimizer swap chunk, ``optim_extra`` more
    keys of offload_optimizer. Left out (None): the config's default."""
    zero = {"stage": stage, **zero_extra}
    if bucket is not None:
        zero["reduce_bucket_size"] = bucket
    if param is not None:
        zero["offload_param"] = {"device": param, "nvme_path": nvme}
    if optim is not None:
        zero["offload_optimizer"] = {"device": optim, "nvme_path": nvme, **(optim_extra or {})}
        if chunk is not None:
            zero["offload_optimizer"]["chunk_size"] = chunk
    if prefetch is not None:
        zero["prefetch"] = prefetch
    optimizer = {"lr": lr}
    if adam is not None:
        optimizer["type"] = adam
    if weight_decay is not None:
        optimizer["weight_decay"] = weight_decay
    cfg = {"zero": zero, "precision": precision or {"dtype": dtype}, "optimizer": optimizer, "gradient_clipping": clip}
    if accumulation is not None:
        cfg["gradient_accumulation_steps"] = accumulation
    return cfg


def streamed_nvme_config(nvme, dtype="fp32", **aio) -> dict:
    """Stage 3 with everything on NVMe and every optimizer range streamed from disk (no host
    cache, gradients in a swap file, no parameter cache): each swap file is read back every
    step; ``aio`` keys. fp32 parameters are master.swp (Note [parameters from the master] in _placement.py):
    bf16 has a params.swp."""
    cfg = zero_config(3, param="nvme", optim="nvme", nvme=nvme, chunk=4096, dtype=dtype,
                      optim_extra={"host_cache": 0, "gradients": "nvme"})
    cfg["zero"]["offload_param"]["max_in_cpu"] = 0
    cfg["aio"] = dict(aio)
    return cfg
