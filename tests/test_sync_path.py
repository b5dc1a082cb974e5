"""The sync path without waste (issue 19): the one-pass finiteness check, the Comm's reused
buffers, the flat outer step (and old checkpoints of the per-parameter one), the training
loss read every --log-every steps, and a non-finite inner step skipped on the device."""

import importlib
import os

import pytest
import torch

import loco
from loco.algorithms.base import NonFiniteError, all_finite
from loco.algorithms.streaming_diloco import _flat_outer_state
from loco.comm.codecs import get_codec
from loco.training import Loop
from workers import batch, make_model

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("values, finite", [
    ([1.0, -2.0, 3.5], True),
    ([1.0, float("nan"), 3.0], False),
    ([1.0, float("inf"), -float("inf")], False),  # their sum is NaN: still caught
    ([-float("inf"), 0.0], False),
    ([3e38, 3e38, -1.0], True),  # the sum overflows; every element is finite
    ([], True),
])
def test_all_finite_is_exact(values, finite):
    assert all_finite(torch.tensor(values, dtype=torch.float32)) is finite


def scratch_worker(ctx, sizes, codec_name):
    """Mean-all-reduces of the sizes in turn; the buffers the Comm used after each."""
    codec = None if codec_name is None else get_codec(codec_name)
    out = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, generator=torch.Generator().manual_seed(100 * ctx.rank + i))
        want = x.clone()
        got = ctx.comm.all_reduce_mean(x, codec=codec).wait().clone()
        out.append((want, got, {k: v.data_ptr() for k, v in ctx.comm._buffers.items()}))
    return out


@pytest.mark.parametrize("codec", [None, "fp32", "bf16", "fp4_e3m0"])
def test_reduce_reuses_its_buffers_and_pads_with_zeros(codec):
    """A large reduction, then smaller ones that need padding: every result is the mean
    of the workers' values (exact for two fp32 workers; as the codec's round trip of the
    mean of round trips otherwise), and the smaller ones allocate nothing new (the same
    buffers, whose stale tails are zeroed before use). A codec that writes straight into a
    buffer (the bf16 cast; the scaled codecs, eager or fused) encodes and decodes into kept
    ones too; the
    unencoded mean (fp32 too, lossless) is the group's all-reduce, which keeps none."""
    sizes = [1000, 333, 333, 1000]  # 333 = 2 chunks of 167 minus 1: padded
    out = loco.launch(scratch_worker, 2, args=(sizes, codec))
    for i, n in enumerate(sizes):
        mean = (out[0][i][0] + out[1][i][0]) / 2
        for r in range(2):
            got = out[r][i][1]
            if codec in (None, "fp32"):
                assert torch.equal(got, mean)
            else:  # each 4-bit value is within one step of its block's grid
                assert (got - mean).abs().max() <= mean.abs().max()
        assert torch.equal(out[0][i][1], out[1][i][1])
    for r in range(2):
        assert out[r][1][2] == out[r][2][2] == out[r][3][2]  # no new buffer after the first
        roles = {role for role, _ in out[r][0][2]}
        kept = {"outgoing", "decoded", "mine"}  # the codec's results
        assert kept <= roles if codec in ("bf16", "fp4_e3m0") else not kept & roles
        assert bool(roles) == (codec in ("bf16", "fp4_e3m0"))


def test_old_per_parameter_outer_state_loads_flat():
    """A checkpoint of the per-parameter outer optimizer becomes the flat one's: the momenta
    concatenated in order; without momenta, none."""
    a, b = torch.randn(2, 3), torch.randn(4)
    old = {"state": {0: {"momentum_buffer": a}, 1: {"momentum_buffer": b}},
           "param_groups": [{"lr": 0.7, "momentum": 0.9, "params": [0, 1]}]}
    new = _flat_outer_state(old)
    assert new["param_groups"][0]["params"] == [0] and new["param_groups"][0]["lr"] == 0.7
    assert torch.equal(new["state"][0]["momentum_buffer"], torch.cat([a.view(-1), b]))
    fresh = {"state": {}, "param_groups": [{"lr": 0.7, "params": [0, 1]}]}
    assert _flat_outer_state(fresh)["state"] == {}


def test_losses_read_every_log_are_the_python_sum():
    """The losses kept on the device and read at a log give the same float as adding each
    step's ``loss.item()`` to a Python float (the logged train_loss did not change)."""
    values = torch.rand(37, dtype=torch.float32) * 10
    loop, reference = Loop(loss_sum=1.25), 1.25
    for v in values:
        loop.add_loss(v.clone())
        reference += v.item()
    loop.settle_losses()
    assert loop.loss_sum == reference and loop.loss_count == 37 and not loop.losses


def device_skip_worker(ctx, on_device, policy, poison_at, steps):
    """Local training with fused AdamW; the gradient is poisoned at one step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    algo = loco.Local(model, opt, ctx.comm, on_nonfinite=policy)
    algo.nonfinite.skip_on_device = on_device
    for t in range(1, steps + 1):
        x, y = batch(ctx.rank, t)
        model(x, y).backward()
        if t == poison_at:
            next(iter(model.parameters())).grad[0, 0] = float("nan")
        try:
            algo.step()
        except NonFiniteError as err:
            return {"stopped": str(err), "at": t}
        algo.zero_grad()
    try:
        algo.settle_nonfinite()
    except NonFiniteError as err:
        return {"stopped": str(err), "at": "settle",
                "params": [p.detach().clone() for p in model.parameters()]}
    return {"skipped": dict(algo.skipped), "params": [p.detach().clone() for p in model.parameters()]}


def test_nonfinite_step_skipped_on_the_device_is_the_host_skip():
    """With ``skip_on_device`` (what CUDA with a fused optimizer uses; forced here on the
    CPU's fused AdamW) the poisoned step is skipped by the optimizer itself: the parameters
    are bit for bit those of the host's decision, and the skip is counted once read."""
    host = loco.launch(device_skip_worker, 1, args=(False, "skip", 3, 5))[0]
    device = loco.launch(device_skip_worker, 1, args=(True, "skip", 3, 5))[0]
    assert host["skipped"] == device["skipped"] == {"inner_steps": 1, "syncs": 0}
    assert all(torch.equal(a, b) for a, b in zip(host["params"], device["params"]))
    stopped = loco.launch(device_skip_worker, 1, args=(True, "stop", 3, 5))[0]
    assert stopped["at"] == "settle"  # raised when read, with the step left out
    assert "1 inner step(s) between steps 1 and 5" in stopped["stopped"]
    assert all(torch.equal(a, b) for a, b in zip(host["params"], stopped["params"]))


def test_algorithms_prepare_their_codecs_before_the_first_step(monkeypatch):
    """Streaming DiLoCo prepares (compiles, where fused) the kernels of every fragment's
    all-reduce and NoLoCo those of its exchange, in the constructor: nothing is compiled
    inside the first syncs."""
    from loco.comm.codecs import Codec

    calls = []
    monkeypatch.setattr(Codec, "prepare", lambda self, numel, parts=1, device=None:
                        calls.append((self.name, numel, parts)) or "eager")
    model = make_model(layers=4)
    comm = loco.Comm(None, 0, 1)
    try:
        algo = loco.StreamingDiLoCo(model, torch.optim.AdamW(model.parameters()), comm,
                                    sync_every=4, fragments=2, codec="fp4_e3m0")
        assert calls == [("fp4_e3m0", f.delta.numel(), 1) for f in algo.fragment_list]
    finally:
        comm.close()
    calls.clear()
    sizes = loco.launch(noloco_worker, 2)
    assert sorted(calls) == sorted((name, n, 1) for n in sizes for name in ("int8", "fp32"))


def noloco_worker(ctx):
    model = make_model(layers=4)
    algo = loco.NoLoCo(model, torch.optim.AdamW(model.parameters()), ctx.comm, sync_every=4,
                       group_size=2, codec="int8", warn=False)
    return algo.slow.numel()


# ----------------------------------------------- the GPU path, as far as a CPU can show it
def test_adamw_is_fused_on_a_gpu_and_a_cpu_and_skips_on_the_device_only_on_a_gpu():
    """``loco train``'s AdamW is fused on a GPU (so ``skip_on_device`` holds and no step
    reads the gradient norm on the host) and on a CPU (no whole-model temporaries), torch's
    default elsewhere. A CPU cannot hold a GPU's parameters: the choice is asked of stand-in
    modules."""
    from types import SimpleNamespace

    from loco.training import optimizers

    def on(device):
        class Stand(torch.nn.Module):
            def parameters(self, recurse=True):
                return iter([SimpleNamespace(device=torch.device(device))])
        return Stand()

    model = make_model()
    assert optimizers.wants_fused(on("cuda")) is True
    assert optimizers.wants_fused(on("meta")) is None
    fused = optimizers.inner_optimizer(model, "adamw", lr=1e-3, weight_decay=0.1,
                                       betas=(0.9, 0.95))
    assert fused.defaults["fused"] and fused._step_supports_amp_scaling  # takes found_inf
    algo = loco.DiLoCo(model, fused, loco.Comm(None, 0, 1), sync_every=4)
    assert not algo.nonfinite.skip_on_device  # a CPU reads the norm for free


def test_batches_go_to_a_gpu_from_pinned_memory_without_blocking(monkeypatch):
    """Each batch is copied to a GPU once, from page-locked memory, ``non_blocking``; on the
    CPU nothing is pinned. Pinning and the copy are recorded by stand-ins (no GPU here)."""
    import numpy as np

    from loco.data.loader import _gather

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self: calls.append("pin") or self.clone())
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and str(args[0]).startswith("cuda"):
            calls.append(("to", str(args[0]), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    tokens, windows = np.arange(100), np.array([0, 3])
    x, y = _gather(tokens, windows, 8, "cpu")
    assert calls == [] and torch.equal(y, x + 1)
    gx, gy = _gather(tokens, windows, 8, "cuda:0")
    assert calls == ["pin", ("to", "cuda:0", True)]  # one copy for inputs and targets
    assert torch.equal(gx, x) and torch.equal(gy, y) and gx.is_contiguous()


def test_every_rank_torchrun_starts_gets_its_share_of_the_cores(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 in every rank: loco gives each rank the machine's
    cores divided by the ranks on it (as its own processes launcher does)."""
    import os

    launch = importlib.import_module("loco.runtime.launch")  # the module, not its function

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("LOCO_CPU_THREADS", raising=False)
    for ranks, want in (("1", 16), ("4", 4), ("32", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        launch.share_cores()
        assert threads[-1] == want
    monkeypatch.setenv("LOCO_CPU_THREADS", "3")  # given: whatever the ranks and cores
    launch.share_cores()
    assert threads[-1] == 3
    monkeypatch.setenv("LOCO_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="LOCO_CPU_THREADS must be a whole number >= 1"):
        launch.share_cores()


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8", "fp4_e3m0", "fp4_e2m1", "int2"])
def test_scaled_codecs_do_not_read_the_device_off_the_cpu(name):
    """Off the CPU the scaled codecs mask non-finite blocks without asking the host whether
    there are any (that read would stall the communication thread at every encode and
    decode): on the ``meta`` device, which has no data to read, both run through."""
    codec = get_codec(name)
    x = torch.empty(4, 2 * codec.block, device="meta")
    buf = codec._encode_rows(x)
    assert buf.device.type == "meta" and codec._decode_rows(buf, 2 * codec.block).shape == x.shape


def _affinity(ctx):
    import threading
    seen = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))  # its own thread
    t.start()
    t.join()
    return os.sched_getaffinity(0), seen[0]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux: thread affinity")
def test_thread_ranks_share_one_core_only_when_asked(monkeypatch):
    """$LOCO_THREADS_ONE_CORE=1: every rank of a threads launch, and the threads a rank
    starts, run on one core, the same for all; 0 (the default): where the process may run;
    anything else is refused naming the variable. The launching thread is left as it was."""
    whole = os.sched_getaffinity(0)
    monkeypatch.setenv("LOCO_THREADS_ONE_CORE", "1")
    pinned = loco.launch(_affinity, 3)
    assert len({frozenset(s) for r in pinned for s in r}) == 1
    assert len(pinned[0][0]) == 1 and pinned[0][0] <= whole
    assert os.sched_getaffinity(0) == whole
    monkeypatch.setenv("LOCO_THREADS_ONE_CORE", "0")
    assert all(s == whole for r in loco.launch(_affinity, 2) for s in r)
    monkeypatch.setenv("LOCO_THREADS_ONE_CORE", "yes")
    with pytest.raises(ValueError, match="LOCO_THREADS_ONE_CORE must be 0 or 1"):
        loco.launch(_affinity, 2)


def test_the_processes_launcher_binds_a_port_the_kernel_picks(monkeypatch):
    """torch elastic's agent for a processes launch binds its rendezvous store to port 0, so
    the kernel picks a free port as it binds: a port picked free beforehand could be taken
    by another job before the agent binds it (EADDRINUSE)."""
    import torch.distributed.launcher.api as api

    configs = []
    monkeypatch.setattr(api, "elastic_launch", lambda config, entry: configs.append(config))
    importlib.import_module("loco.runtime.launch")._elastic_agent(loco.Mesh(2), 0)
    (config,) = configs
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "127.0.0.1:0"
