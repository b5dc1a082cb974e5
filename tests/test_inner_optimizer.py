"""``--inner-optimizer``: AdamW, or MuLoCo's Muon on the hidden matrices and AdamW on the rest,
as one optimizer: which parameters go where (built-in and Hugging Face models, whole and in
pipeline stages), one step equal to the two reference optimizers stepped apart, exact resume
through ``state_dict`` and through ``loco train --resume``, and the one-line errors."""

import copy
import io
import json
import sys

import pytest
import torch
from test_cli import small_run
from test_reliability import assert_same_tensors, final_state, job, records

import loco.training.job
from loco.cli import main
from loco.config import ConfigError, TrainConfig, validate
from loco.model import Transformer, model_config
from loco.training.build import adamw, make_optimizer
from loco.training.optimizers import (
    MUON_LR_ADJUST,
    MuonAdamW,
    inner_optimizer,
    split_muon,
)

VOCAB, SEQ = 300, 16
CFG = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def tiny(seed=0):
    return Transformer(model_config("tiny", VOCAB, SEQ), torch.Generator().manual_seed(seed))


def names(model, params):
    ids = {id(p) for p in params}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def loss_of(model, step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return model(x[:, :-1], x[:, 1:])


def train(model, optimizer, steps, start=0, schedule=None):
    for step in range(start, start + steps):
        optimizer.zero_grad()
        loss_of(model, step).backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()


def test_builtin_model_hidden_matrices_go_to_muon():
    model = tiny()
    hidden, rest = split_muon(model)
    per_block = ["attn.proj.weight", "attn.qkv.weight", "mlp.w1.weight", "mlp.w2.weight",
                 "mlp.w3.weight"]
    assert names(model, hidden) == [f"blocks.{i}.{n}" for i in range(2) for n in per_block]
    assert "embed.weight" in names(model, rest)  # also the (tied) output head
    assert all(p.dim() == 1 for p in rest if p is not model.embed.weight)
    assert len(hidden) + len(rest) == len(list(model.parameters()))
    # A pipeline stage's part: the first holds the embedding, the last the tied head.
    first, last = model.stage_part(0, 2), model.stage_part(1, 2)
    assert names(first, split_muon(first)[0]) == [f"blocks.0.{n}" for n in per_block]
    assert "embed.weight" in names(last, split_muon(last)[1])
    assert names(last, split_muon(last)[0]) == [f"blocks.1.{n}" for n in per_block]


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "gpt2"])
def test_hugging_face_embeddings_and_head_go_to_adamw(kind, tmp_path):
    pytest.importorskip("transformers")
    from test_hf_models import write_gpt2, write_llama

    from loco import hf

    path = (write_gpt2(tmp_path) if kind == "gpt2"
            else write_llama(tmp_path, tie=kind == "llama-tied"))
    model = hf.build(path, VOCAB, seed=0)
    hidden, rest = split_muon(model)
    inner = model.hf
    outside = {id(inner.get_input_embeddings().weight), id(inner.get_output_embeddings().weight)}
    assert outside <= {id(p) for p in rest} and not outside & {id(p) for p in hidden}
    if kind == "gpt2":
        assert "hf.transformer.wpe.weight" in names(model, rest)  # position embeddings
        assert names(model, hidden) == sorted(f"hf.transformer.h.{i}.{m}.weight" for i in range(2)
                                              for m in ("attn.c_attn", "attn.c_proj",
                                                        "mlp.c_fc", "mlp.c_proj"))
    else:
        projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        assert names(model, hidden) == sorted(f"hf.model.layers.{i}.{m}.weight"
                                              for i in range(2) for m in projections)
    embeddings = outside | {id(m.weight) for m in model.modules()
                            if isinstance(m, torch.nn.Embedding)}
    assert all(p.dim() != 2 for p in rest if id(p) not in embeddings)
    if kind == "llama":  # the last pipeline stage's head is found by its name
        last = model.stage_part(1, 2)
        assert "hf.lm_head.weight" in names(last, split_muon(last)[1])
        assert len(split_muon(last)[0]) == 7


def reference(model, muon_lr=CFG["lr"], adjust_lr_fn="match_rms_adamw"):
    """Muon on the hidden matrices and AdamW on the rest, as two plain torch optimizers."""
    hidden, rest = split_muon(model)
    muon = torch.optim.Muon(hidden, lr=muon_lr, weight_decay=CFG["weight_decay"],
                            adjust_lr_fn=adjust_lr_fn)
    adam = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2],
                               "weight_decay": CFG["weight_decay"]},
                              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                             lr=CFG["lr"], betas=CFG["betas"], fused=True)
    return muon, adam


def test_combined_steps_equal_muon_and_adamw_stepped_apart():
    a, b = tiny(), tiny()
    combined = inner_optimizer(a, "muon", **CFG)
    assert isinstance(combined, MuonAdamW) and MUON_LR_ADJUST == "match_rms_adamw"
    muon, adam = reference(b)
    shapes = [[p.shape for p in g["params"]] for g in combined.param_groups]
    assert shapes == [[p.shape for p in g["params"]] for g in muon.param_groups + adam.param_groups]
    for step in range(3):
        train(a, combined, 1, step)
        for opt in (muon, adam):
            opt.zero_grad()
        loss_of(b, step).backward()
        muon.step()
        adam.step()
        assert_same_tensors(a.state_dict(), b.state_dict())
    w1 = "blocks.0.mlp.w1.weight"
    assert not torch.equal(tiny().state_dict()[w1], a.state_dict()[w1])  # Muon moved it


@pytest.mark.parametrize("scale, adjust_lr_fn", [("original", "original"),
                                                ("adamw-rms", "match_rms_adamw")])
def test_muon_has_its_own_rate_and_scaling_on_the_one_schedule(scale, adjust_lr_fn):
    """``--muon-lr`` and ``--muon-scale``: Muon at its own rate with torch.optim.Muon's
    ``adjust_lr_fn`` of that name, AdamW at ``--lr``, one schedule scaling both (stepped
    apart as two plain optimizers with their own schedulers, bit for bit)."""
    def halve(step):
        return 0.5 ** step

    a, b = tiny(), tiny()
    combined = inner_optimizer(a, "muon", **CFG, muon_lr=0.02, muon_scale=scale)
    schedule = torch.optim.lr_scheduler.LambdaLR(combined, halve)
    muon, adam = reference(b, muon_lr=0.02, adjust_lr_fn=adjust_lr_fn)
    apart = [torch.optim.lr_scheduler.LambdaLR(o, halve) for o in (muon, adam)]
    for step in range(3):
        train(a, combined, 1, step, schedule)
        for opt, sched in zip((muon, adam), apart):
            opt.zero_grad()
        loss_of(b, step).backward()
        for opt, sched in zip((muon, adam), apart):
            opt.step()
            sched.step()
        assert_same_tensors(a.state_dict(), b.state_dict())
    assert combined.param_groups[0]["lr"] == 0.02 * halve(3)
    assert combined.param_groups[-1]["lr"] == CFG["lr"] * halve(3)


@pytest.mark.numerics
def test_muon_skips_a_nonfinite_step_on_the_device_and_steps_alike_otherwise():
    """With ``found_inf`` (what ``Algorithm`` sets where the step is skipped on the device)
    the combined optimizer steps bit for bit as Muon and AdamW stepped apart when it is 0,
    and leaves every parameter and state tensor as it was when it is 1."""
    a, b = tiny(), tiny()
    combined = inner_optimizer(a, "muon", **CFG)
    assert combined._step_supports_amp_scaling
    muon, adam = reference(b)
    for step in range(3):
        loss_of(a, step).backward()
        loss_of(b, step).backward()
        if step == 1:  # a non-finite step: nothing may move, the gradient is ignored
            before = copy.deepcopy((a.state_dict(), combined.state_dict()))
            combined.found_inf = torch.ones(())
            next(a.parameters()).grad[0] = float("nan")
            combined.step()
            assert_same_tensors(a.state_dict(), before[0])
            assert_same_tensors(combined.state_dict()["state"], before[1]["state"])
            for opt in (muon, adam, combined):
                opt.zero_grad()
            continue
        combined.found_inf = torch.zeros(())
        combined.step()
        del combined.found_inf
        muon.step()
        adam.step()
        for opt in (muon, adam, combined):
            opt.zero_grad()
        assert_same_tensors(a.state_dict(), b.state_dict())


def test_adamw_default_is_the_plain_adamw():
    """The default builds the AdamW loco always built: the same groups, parameters, order."""
    cfg, model = TrainConfig(), tiny()
    opt = make_optimizer(model, cfg)
    assert type(opt) is torch.optim.AdamW and cfg.optim.inner_optimizer == "adamw"
    before = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=(0.9, 0.95), fused=True)
    for a, b in zip(opt.param_groups, before.param_groups, strict=True):
        assert a.keys() == b.keys() and all(x is y for x, y in zip(a["params"], b["params"],
                                                                   strict=True))
        assert {k: v for k, v in a.items() if k != "params"} == {
            k: v for k, v in b.items() if k != "params"}
    assert type(adamw(model, cfg)) is torch.optim.AdamW


def test_state_dict_resumes_bit_for_bit_with_a_schedule():
    """Three steps, save (through torch.save), load into a fresh model and optimizer: the
    next three steps equal those of the optimizer that never stopped."""
    model = tiny()
    opt = inner_optimizer(model, "muon", **CFG)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    train(model, opt, 3, 0, sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    fresh = tiny(seed=1)
    opt2 = inner_optimizer(fresh, "muon", **CFG)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1 / (s + 1))
    fresh.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert all(p.state is opt2.state for p in opt2.parts)
    assert [g["lr"] for p in opt2.parts for g in p.param_groups] == [
        g["lr"] for g in opt2.param_groups]
    train(model, opt, 3, 3, sched)
    train(fresh, opt2, 3, 3, sched2)
    assert_same_tensors(model.state_dict(), fresh.state_dict())
    assert_same_tensors(opt.state_dict(), opt2.state_dict())
    assert any("momentum_buffer" in s for s in opt.state.values())
    opt.state.clear()  # what a healed worker does: both parts start from zero
    assert all(not p.state for p in opt.parts)
    clone = copy.deepcopy(opt)
    assert all(p.state is clone.state for p in clone.parts)


@pytest.mark.parametrize("extra", [("--algorithm", "diloco"),
                                   ("--algorithm", "noloco", "--stages", "2"),
                                   ("--muon-lr", "0.02", "--muon-scale", "original")])
def test_muon_trains_end_to_end(extra, corpus, tmp_path):
    """DiLoCo, NoLoCo with pipeline stages (each stage's part has its own split), and Muon
    at its own rate and scaling (the logged lr is AdamW's, ``--lr``)."""
    out = tmp_path / "run"
    assert main(small_run(corpus, out, *extra, "--inner-optimizer", "muon",
                          "--final-eval-batches", "2")) == 0
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert summary["final_eval_loss"] < 5.7 and losses[-1] < losses[0]
    assert summary["config"]["inner_optimizer"] == "muon"
    lrs = [r["lr"] for r in lines if "lr" in r]
    assert max(lrs) <= float(summary["config"]["lr"])


@pytest.mark.parametrize("ranks", [1, 2])
def test_interrupted_muon_run_resumes_bit_identical(ranks, corpus, tmp_path, monkeypatch,
                                                    capsys):
    """Worker 1 (with 2 ranks: worker 0's second rank, its tensors through DCP) fails at
    step 11, after the checkpoint of step 8; the resumed run ends as the uninterrupted."""
    extra = ("--algorithm", "diloco", "--inner-optimizer", "muon", "--worker-ranks", str(ranks))
    full, out = tmp_path / "full", tmp_path / "run"
    assert main(job(corpus, full, *extra)) == 0
    monkeypatch.setenv("LOCO_FAULT", "1:11")
    assert main(job(corpus, out, *extra)) == 1
    assert "worker 1 failed at step 11" in capsys.readouterr().err
    monkeypatch.delenv("LOCO_FAULT")
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert records(out) == records(full)
    for rank in range(2 * ranks):
        assert_same_tensors(final_state(out, rank)["algorithm"],
                            final_state(full, rank)["algorithm"])


@pytest.mark.parametrize("argv, allowed", [
    (["--inner-optimizer", "sgd"], "'adamw', 'muon'"),
    (["--muon-lr", "0.02"], "--muon-lr: needs --inner-optimizer muon"),
    (["--inner-optimizer", "muon", "--muon-lr", "0"], "--muon-lr: must be a number > 0"),
    (["--inner-optimizer", "muon", "--muon-scale", "spectral"], "'adamw-rms', 'original'"),
    (["--inner-optimizer", "muon", "--worker-ranks", "2", "--worker-parallel", "fsdp",
      "--launcher", "processes"], "--worker-parallel fsdp"),
])
def test_bad_inner_optimizer_is_a_one_line_error(argv, allowed, corpus, tmp_path, capsys,
                                                 monkeypatch):
    monkeypatch.setattr(loco.training.job, "launch",
                        lambda *a, **k: pytest.fail("workers started"))
    with pytest.raises(SystemExit) as e:
        sys.exit(main(small_run(corpus, tmp_path, *argv)))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and allowed in err


def test_fsdp_refusal_names_the_option():
    cfg = TrainConfig(inner_optimizer="muon", worker_ranks=2, worker_parallel="fsdp")
    with pytest.raises(ConfigError, match="^--inner-optimizer: muon .*fsdp"):
        validate(cfg)
