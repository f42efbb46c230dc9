"""The native CPU Adam (infinity.optim): parity with torch.optim.Adam/AdamW, every SIMD path
against the scalar reference, exact low-precision conversions, bad input, threads."""
import copy
import math
import multiprocessing
import threading

import pytest
import torch

from infinity.optim import CPUAdam, _native, adam_step, simd_path

FEATURES = _native.cpu_features()
PATHS = ["scalar"] + [p for p in ("avx2", "avx512") if FEATURES[p]]
if FEATURES["avx512"]:
    PATHS.append("avx512_nobf16")  # the integer bf16 rounding used on CPUs without avx512_bf16
SIZES = [1, 7, 15, 16, 17, 1 << 20]
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
LOW = [torch.bfloat16, torch.float16]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def torch_opt(param, adamw, **hp):
    return (torch.optim.AdamW if adamw else torch.optim.Adam)([param], foreach=False, **hp)


# ---------------------------------------------------------------- path selection


def test_simd_path_is_the_best_supported_one(monkeypatch):
    monkeypatch.delenv("INFINITY_CPU_ISA", raising=False)  # uncapped: the CPU's own best (test_cpu_isa caps it)
    monkeypatch.delenv(_native.ENV_SIMD, raising=False)
    best = "avx512" if FEATURES["avx512"] else "avx2" if FEATURES["avx2"] else "scalar"
    assert simd_path() == best


def test_env_var_pins_the_path(monkeypatch):
    monkeypatch.setenv(_native.ENV_SIMD, "scalar")
    assert simd_path() == "scalar"
    monkeypatch.setenv(_native.ENV_SIMD, "sse9")
    with pytest.raises(ValueError, match="INFINITY_CPU_ADAM_SIMD"):
        simd_path()


# ---------------------------------------------------------------- parity with torch


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam+L2"])
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch_over_100_steps(adamw, n):
    g = gen(n)
    p0 = torch.randn(n, generator=g)
    ref = p0.clone().requires_grad_()
    opt = torch_opt(ref, adamw, **HP)
    ours = {path: (p0.clone(), torch.zeros(n), torch.zeros(n)) for path in PATHS}
    for step in range(1, 101):
        grad = torch.randn(n, generator=g)
        ref.grad = grad
        opt.step()
        for path, (p, m, v) in ours.items():
            adam_step(p, grad, m, v, step=step, adamw=adamw, simd=path, **HP)
    st = opt.state[ref]
    for path, (p, m, v) in ours.items():
        torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-7, msg=lambda s: f"{path}: {s}")
        # exp_avg is a running sum of O(0.1) terms: near its zero crossings the error is
        # ulps of those terms, so the absolute floor is 1e-5 of its scale (~0.2), not of 0
        torch.testing.assert_close(m, st["exp_avg"], rtol=1e-5, atol=2e-6, msg=lambda s: f"{path}: {s}")
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-5, atol=1e-10, msg=lambda s: f"{path}: {s}")


@pytest.mark.parametrize("grad_dtype", LOW)
@pytest.mark.parametrize("out_dtype", LOW)
def test_mixed_precision_equals_torch_with_casts(grad_dtype, out_dtype):
    n = 4099
    g = gen(1)
    p0 = torch.randn(n, generator=g)
    ref = p0.clone().requires_grad_()
    opt = torch_opt(ref, True, **HP)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    for step in range(1, 21):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        ref.grad = grad.float()
        opt.step()
        adam_step(p, grad, m, v, step=step, params_out=out, **HP)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-7)
    assert torch.equal(out, p.to(out_dtype))  # the fused cast is exactly torch's cast
    # fp32 results a few ulps apart may round to neighbouring low-precision values
    torch.testing.assert_close(out.float(), ref.detach().to(out_dtype).float(), rtol=2**-7, atol=0)


# ---------------------------------------------------------------- SIMD paths vs scalar


@pytest.mark.parametrize("path", [p for p in PATHS if p != "scalar"])
@pytest.mark.parametrize("grad_dtype", [torch.float32] + LOW)
@pytest.mark.parametrize("out_dtype", [None] + LOW)
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam+L2"])
def test_simd_path_matches_scalar_reference(path, grad_dtype, out_dtype, adamw):
    n = 16 * 64 + 13  # vector body plus a tail
    g = gen(2)
    p0 = torch.randn(n, generator=g)
    runs = {}
    for which in ("scalar", path):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        gg = gen(3)
        for step in range(1, 11):
            grad = torch.randn(n, generator=gg).to(grad_dtype)
            adam_step(p, grad, m, v, step=step, adamw=adamw, params_out=out, simd=which, **HP)
        runs[which] = (p, m, v, out)
    (p_s, m_s, v_s, _), (p, m, v, out) = runs["scalar"], runs[path]
    torch.testing.assert_close(p, p_s, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, m_s, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v, v_s, rtol=1e-6, atol=1e-10)
    if out is not None:
        assert torch.equal(out, p.to(out_dtype))


def special_values():
    """fp32 values that exercise rounding: ties, subnormals (fp32 and fp16), overflow."""
    tiny = torch.tensor([1e-45, 1e-40, 1.1754942e-38, 1.1754944e-38, 3e-39, 2**-24, 2**-25,
                         3 * 2**-26, 2**-14, 2**-14 - 2**-25, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8])
    big = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 1e5, 3.3895e38, 3.4e38,
                        float("inf"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 0.0])
    ties = torch.arange(0, 1 << 12, dtype=torch.int32).view(torch.float32)  # low bits only
    bits = (torch.randint(-(2**31), 2**31 - 1, (5000,), generator=gen(4), dtype=torch.int64)
            .to(torch.int32).view(torch.float32))
    bits = bits[torch.isfinite(bits)]
    base = torch.cat([tiny, big, ties, bits, torch.randn(1000, generator=gen(5))])
    return torch.cat([base, -base])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_dtype", LOW)
def test_params_out_rounds_exactly_like_torch(path, out_dtype):
    p = special_values()
    n = p.numel()
    before = p.clone()
    out = torch.empty(n, dtype=out_dtype)
    # lr = 0 and no decay leave p unchanged, so out must be exactly p.to(out_dtype)
    adam_step(p, torch.randn(n, generator=gen(6)), torch.zeros(n), torch.zeros(n), step=1, lr=0.0,
              params_out=out, simd=path)
    assert torch.equal(p, before)
    assert torch.equal(out, before.to(out_dtype))
    nan_p = torch.full((19,), float("nan"))
    nan_out = torch.empty(19, dtype=out_dtype)
    adam_step(nan_p, torch.ones(19), torch.zeros(19), torch.zeros(19), step=1, lr=0.0, params_out=nan_out, simd=path)
    assert torch.isnan(nan_out.float()).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("grad_dtype", LOW)
def test_low_precision_grads_widen_exactly(path, grad_dtype):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    grad = every[torch.isfinite(every.float())]
    n = grad.numel()
    m = torch.zeros(n)
    # beta1 = 0 makes exp_avg = g exactly
    adam_step(torch.zeros(n), grad, m, torch.zeros(n), step=1, lr=0.0, betas=(0.0, 0.999), simd=path)
    assert torch.equal(m, grad.float())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("grad_dtype", [torch.float32] + LOW)
@pytest.mark.parametrize("adamw", [True, False])
def test_grad_scale_equals_scaling_the_gradients_first(path, grad_dtype, adamw):
    """Clipping folded into the pass: bit for bit what grads.mul_(scale) then the step gives."""
    g = torch.Generator().manual_seed(7)
    n = 1000 + 13  # a tail on every path
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g).to(grad_dtype)
    scale = 0.3127
    folded = (p0.clone(), torch.zeros(n), torch.zeros(n))
    first = (p0.clone(), torch.zeros(n), torch.zeros(n))
    for step in (1, 2):
        adam_step(folded[0], grad, folded[1], folded[2], step=step, adamw=adamw, simd=path, grad_scale=scale, **HP)
        adam_step(first[0], grad.float() * scale, first[1], first[2], step=step, adamw=adamw, simd=path, **HP)
    for ours, ref in zip(folded, first):
        assert torch.equal(ours, ref)


# ---------------------------------------------------------------- layout and threads


def test_views_with_storage_offset_update_only_their_slice():
    n = 10_000
    g = gen(7)
    p, grad, m, v = (torch.randn(n, generator=g) for _ in range(4))
    v = v.abs()
    whole = [t.clone() for t in (p, grad, m, v)]
    adam_step(*whole, step=3, **HP)
    pieces = [t.clone() for t in (p, grad, m, v)]
    for lo, hi in ((0, 3), (3, 1003), (1003, 7777), (7777, n)):
        adam_step(*(t[lo:hi] for t in pieces), step=3, **HP)
    for a, b in zip(pieces, whole):
        assert torch.equal(a, b)
    untouched = [t.clone() for t in (p, grad, m, v)]
    adam_step(*(t[5:9] for t in untouched), step=3, **HP)
    assert torch.equal(untouched[0][:5], p[:5]) and torch.equal(untouched[0][9:], p[9:])


@pytest.mark.parametrize("path", PATHS)
def test_results_do_not_depend_on_thread_count(path):
    n = (1 << 17) + 5
    g = gen(8)
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16()
    results = []
    for threads in (1, 2, 3):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        adam_step(p, grad, m, v, step=1, params_out=out, num_threads=threads, simd=path, **HP)
        results.append((p, m, v, out))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_concurrent_calls_from_python_threads():
    n = 1 << 18
    g = gen(9)
    inputs = [(torch.randn(n, generator=g), torch.randn(n, generator=g)) for _ in range(4)]
    expected = []
    for p0, grad in inputs:
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        adam_step(p, grad, m, v, step=1, **HP)
        expected.append(p)
    got = [None] * len(inputs)

    def work(i):
        p, m, v = inputs[i][0].clone(), torch.zeros(n), torch.zeros(n)
        for _ in range(3):
            q = inputs[i][0].clone()
            adam_step(q, inputs[i][1], torch.zeros(n), torch.zeros(n), step=1, num_threads=2, **HP)
        adam_step(p, inputs[i][1], m, v, step=1, num_threads=2, **HP)
        got[i] = p

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _step_in_child(queue):
    torch.set_num_threads(1)  # keep torch's own OpenMP pool out of it: this is about ours
    n = 1 << 17
    p = torch.ones(n)
    adam_step(p, torch.ones(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.5, num_threads=2)
    queue.put(float(p[0]))


def test_thread_pool_survives_fork():
    n = 1 << 17
    adam_step(torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.5, num_threads=2)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_step_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == pytest.approx(0.5, rel=1e-6)


# ---------------------------------------------------------------- bad input


def valid(n=8):
    return dict(params=torch.zeros(n), grads=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(params=torch.zeros(8, 2)[:, 0]), ValueError, "params is not contiguous"),
        (dict(grads=torch.zeros(16)[::2]), ValueError, "grads is not contiguous"),
        (dict(params=torch.zeros(8, dtype=torch.float64)), TypeError, "params has dtype torch.float64"),
        (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16)), TypeError, "exp_avg has dtype"),
        (dict(grads=torch.zeros(8, dtype=torch.int32)), TypeError, "grads has dtype"),
        (dict(exp_avg_sq=torch.zeros(9)), ValueError, "exp_avg_sq has 9 elements but params has 8"),
        (dict(grads=torch.zeros(7)), ValueError, "grads has 7 elements"),
        (dict(params=torch.zeros(8, device="meta")), ValueError, "params is on meta"),
        (dict(params=[0.0] * 8), TypeError, "params must be a torch.Tensor"),
        (dict(params_out=torch.zeros(8)), TypeError, "params_out has dtype torch.float32"),
        (dict(params_out=torch.zeros(4, dtype=torch.bfloat16)), ValueError, "params_out has 4 elements"),
        (dict(step=0), ValueError, "step must be an integer >= 1"),
        (dict(step=1.5), ValueError, "step must be an integer"),
        (dict(lr=-1.0), ValueError, "lr must be a finite number >= 0"),
        (dict(lr=float("nan")), ValueError, "lr must be"),
        (dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be in \[0, 1\)"),
        (dict(betas=0.9), ValueError, "betas must be a pair"),
        (dict(eps=-1e-8), ValueError, "eps must be"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay must be"),
        (dict(adamw="yes"), TypeError, "adamw must be True"),
        (dict(simd="sse2"), ValueError, "not a CPU Adam path"),
        (dict(num_threads=0), ValueError, "num_threads must be a positive integer"),
        (dict(grad_scale=float("inf")), ValueError, "grad_scale must be a finite number"),
    ],
)
def test_bad_input_raises_a_clear_error(change, error, match):
    kwargs = dict(valid(), step=1, lr=1e-3)
    kwargs.update(change)
    with pytest.raises(error, match=match):
        adam_step(**kwargs)


def test_overlapping_buffers_are_refused():
    buf = torch.zeros(16)
    kwargs = dict(valid(), step=1, lr=1e-3)
    kwargs.update(params=buf[:8], exp_avg=buf[4:12])
    with pytest.raises(ValueError, match="share memory"):
        adam_step(**kwargs)


def test_empty_tensors_are_a_no_op():
    adam_step(**valid(0), step=1, lr=1e-3, params_out=torch.empty(0, dtype=torch.float16))


# ---------------------------------------------------------------- CPUAdam


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))


def train(model, opt, steps, sched=None, skip_bias_every=0):
    g = gen(10)
    for i in range(steps):
        x, y = torch.randn(8, 17, generator=g), torch.randn(8, 5, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if skip_bias_every and i % skip_bias_every == 0:
            model[2].bias.grad = None  # a parameter without a gradient this step
        opt.step()
        if sched is not None:
            sched.step()


def groups(model, lr):
    return [
        {"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, model[2].bias], "lr": lr * 3, "betas": (0.8, 0.99), "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam+L2"])
def test_cpu_adam_matches_torch_with_groups_and_scheduler(adamw):
    ours_model, ref_model = make_model(), make_model()
    ours = CPUAdam(groups(ours_model, 1e-2), lr=1e-2, adamw=adamw)
    ref = (torch.optim.AdamW if adamw else torch.optim.Adam)(groups(ref_model, 1e-2), lr=1e-2, foreach=False)
    warm = lambda s: min(1.0, (s + 1) / 10)  # noqa: E731
    train(ours_model, ours, 40, torch.optim.lr_scheduler.LambdaLR(ours, warm), skip_bias_every=3)
    train(ref_model, ref, 40, torch.optim.lr_scheduler.LambdaLR(ref, warm), skip_bias_every=3)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ours.state[ours_model[2].bias]["step"].item() == ref.state[ref_model[2].bias]["step"].item() < 40


def test_cpu_adam_updates_non_contiguous_parameters():
    torch.manual_seed(0)
    base = torch.randn(6, 4)
    ours_p = torch.nn.Parameter(base.clone().t())  # transposed: not contiguous
    ref_p = torch.nn.Parameter(base.clone().t())
    ours, ref = CPUAdam([ours_p], lr=0.1, weight_decay=0.01), torch.optim.AdamW([ref_p], lr=0.1, weight_decay=0.01)
    for _ in range(5):
        grad = torch.randn(4, 6)
        ours_p.grad, ref_p.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(ours_p, ref_p, rtol=1e-5, atol=1e-7)


def test_state_dict_moves_between_cpu_adam_and_torch():
    # CPUAdam -> torch.optim.AdamW: continue both, same result
    a_model, b_model = make_model(), make_model()
    ours = CPUAdam(a_model.parameters(), lr=1e-2, weight_decay=0.05)
    train(a_model, ours, 5)
    b_model.load_state_dict(a_model.state_dict())
    ref = torch.optim.AdamW(b_model.parameters(), lr=1.0, foreach=False)
    # deep copies: state_dict() hands out the live tensors, which would then be shared
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert ref.param_groups[0]["lr"] == 1e-2 and ref.param_groups[0]["weight_decay"] == 0.05
    train(a_model, ours, 5)
    train(b_model, ref, 5)
    for a, b in zip(a_model.parameters(), b_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # torch.optim.Adam -> CPUAdam: the decay rule comes along (L2, not decoupled)
    ref = torch.optim.Adam(b_model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    train(b_model, ref, 3)
    a_model.load_state_dict(b_model.state_dict())
    ours = CPUAdam(a_model.parameters())
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert ours.param_groups[0]["adamw"] is False
    train(a_model, ours, 5)
    train(b_model, ref, 5)
    for a, b in zip(a_model.parameters(), b_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(amsgrad=True), "amsgrad"),
        (dict(maximize=True), "maximize"),
        (dict(fused=True), "foreach/fused"),
        (dict(lr=-1.0), "lr must be"),
        (dict(betas=(1.5, 0.9)), r"betas\[0\]"),
        (dict(num_threads=0), "num_threads"),
        (dict(simd="mmx"), "not a CPU Adam path"),
    ],
)
def test_cpu_adam_refuses_unsupported_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdam([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_cpu_adam_refuses_non_fp32_parameters_and_amsgrad_states():
    with pytest.raises(ValueError, match="fp32 CPU"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    opt = CPUAdam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="parameter 0 of group 1 is a torch.float16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))]})
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "amsgrad": True})
    assert len(opt.param_groups) == 1  # a refused group leaves the optimizer as it was
    p = torch.nn.Parameter(torch.zeros(3))
    ref = torch.optim.AdamW([p], amsgrad=True)
    ours = CPUAdam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="amsgrad"):
        ours.load_state_dict(ref.state_dict())


def test_cpu_adam_refuses_sparse_gradients():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = CPUAdam([p])
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


def test_bias_correction_uses_each_tensors_own_step():
    # after one step, |update| = lr for every element (m_hat / sqrt(v_hat) = sign(g))
    p = torch.nn.Parameter(torch.zeros(5))
    opt = CPUAdam([p], lr=0.25, eps=0.0)
    p.grad = torch.tensor([1.0, -2.0, 3.0, -4.0, 5e-3])
    opt.step()
    assert torch.allclose(p.detach(), -0.25 * torch.sign(p.grad), rtol=1e-6)
    assert math.isclose(opt.state[p]["step"].item(), 1.0)


def test_step_bumps_autograd_versions_like_an_in_place_op():
    p = torch.nn.Parameter(torch.ones(4))
    m, v = torch.zeros(4), torch.zeros(4)
    before = (p._version, m._version, v._version)
    adam_step(p.detach(), torch.ones(4), m, v, step=1, lr=0.1)
    assert all(after > b for after, b in zip((p._version, m._version, v._version), before))
    loss = (p * p).sum()  # p saved for backward, then changed by a step: torch must notice
    opt = CPUAdam([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_worker_threads_follow_the_callers_flush_denormal_mode():
    n = 1 << 18
    assert torch.set_flush_denormal(True)  # FTZ/DAZ on this thread, as torch sets it
    try:
        p = torch.full((n,), 1e-39)  # subnormal: read as zero under denormals-are-zero
        adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, num_threads=2)
    finally:
        torch.set_flush_denormal(False)
    assert torch.count_nonzero(p) == 0  # every element, whichever thread ran it
    q = torch.full((n,), 1e-39)
    adam_step(q, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, num_threads=2)
    assert torch.count_nonzero(q) == n
