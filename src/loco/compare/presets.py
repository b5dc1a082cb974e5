"""What every method of a comparison shares, and the named settings of ``--preset``."""

from __future__ import annotations

from typing import Any

from loco.config import algorithm_names
from loco.config.groups import takers


#: Options every method must share: the same model, data, seed and token budget (and the
#: same machine and network), so that only the methods differ. ``stages`` and ``routing`` (a
#: replica's pipeline layout: the same model and tokens) may differ, to compare routings.
SHARED = ("model", "layers", "dim", "heads", "steps", "tokens", "workers",
          "worker_ranks", "worker_parallel", "batch_size", "seq_len", "seed", "corpus",
          "text_field", "vocab_size", "val_fraction", "cache_dir", "dtype", "eval_every",
          "eval_batches", "final_eval_batches", "log_every", "launcher", "link_bandwidth",
          "link_latency", "fast_link_bandwidth", "fast_link_latency", "out", "progress",
          "resume", "tokenizer", "eval_corpus", "tensorboard", "wandb", "wandb_project",
          "wandb_mode")


def only_for(option: str) -> tuple[str, ...]:
    """The methods an option means something to, where it is some methods' only (their
    ``Method.uses``); every method's name otherwise (the inner optimizer's lr, adam_betas,
    weight_decay, z_loss, ...). --set (or a preset's, a YAML file's per-method entry, a
    --sweep) of an option elsewhere is an error.

    Args:
        option: an option's field name.
    """
    return takers(option) or algorithm_names()


#: The outer optimizer for tens of outer steps, the choice of the sweeps in docs/claims.md
#: (DiLoCo's and NoLoCo's): outer lr 1 (the workers' average) without momentum.
FEW_OUTER_STEPS = {"outer_lr": 1.0, "outer_momentum": 0.0}

#: Streaming DiLoCo as the CPU presets run it: 2 fragments, tau = 1, alpha = 0.5, FP4, with
#: the outer optimizer of few outer steps.
STREAMING_FP4 = {"fragments": 2, "overlap": "1", "mixing": 0.5, "codec": "fp4_e3m0",
                 **FEW_OUTER_STEPS}


#: The failure of ``--preset hetero``'s runs under failures: worker 1 dies half-way through
#: its 480 steps and rejoins from a live worker's state (Decoupled DiLoCo's chaos drills).
FAILURE = {"elastic": True, "fault": "1:240:exit"}


#: The job every preset for a 2-core CPU shares: 4 workers of 4 x 128 tokens, evaluated on 8
#: held-out batches along the way and 50 at the end.
CPU_JOB = {"workers": 4, "batch_size": 4, "seq_len": 128, "eval_batches": 8,
           "final_eval_batches": 50}


#: The attacks of ``--preset adversarial``, each by worker 1 from the first step: (label
#: suffix, ``--inject`` entry). ``noise``'s σ = 1 puts worker 1's contribution far above
#: the guard's 4× the median norm (measured: 12× in SparseLoCo, after its top-k; 160× to
#: 3,000× in the others, DeMo's 4e5×) yet finite, so that plain averaging shows a loss;
#: ``bitflip``'s 64 flips per message hit an fp32 exponent's top bit about twice per
#: message.
ATTACKS = (("scale", "1:scale=-50"), ("noise", "1:noise=1"), ("nan", "1:nan"),
           ("bitflip", "1:bitflip=64"), ("stale", "1:stale=2"), ("zero", "1:zero"))
#: The attack on a worker's claimed speed, for the methods that take ``local_steps:
#: proportional`` (their clean twin ``METHOD-prop`` runs proportional local steps too).
LIE_TOKENS = ("lie-tokens", "1:lie-tokens=10")


def attack_plan(methods: dict[str, dict], proportional: tuple[str, ...]
                ) -> tuple[str, dict[str, dict]]:
    """The runs of an attack comparison: per method, its clean run (label = the method),
    then per attack of ``ATTACKS`` ``METHOD-ATTACK`` (the default guard) and
    ``METHOD-ATTACK-plain`` (``aggregation: mean``); for the methods in ``proportional``,
    also ``METHOD-prop`` (clean, ``local_steps: proportional``) and the ``LIE_TOKENS``
    attack on it, guarded and plain. Each attacked run thus has a clean run that differs
    from it only in ``inject`` and ``aggregation``.

    Args:
        methods: each method's own options (its algorithm's entry), in report order.
        proportional: the methods that also run ``LIE_TOKENS``.

    Returns:
        (``algorithms``, ``methods``) as a preset holds them: ``LABEL=METHOD`` items, and
            the methods' entries followed by the labels' own.
    """
    labels, entries = [], dict(methods)
    for method in methods:
        runs = [(method, {}, ATTACKS)]
        if method in proportional:
            runs.append((f"{method}-prop", {"local_steps": "proportional"}, (LIE_TOKENS,)))
        for clean, options, attacks in runs:
            labels.append(f"{clean}={method}")
            entries.setdefault(clean, options)
            for name, inject in attacks:
                attacked = f"{method}-{name}"
                for label, plain in ((attacked, {}), (f"{attacked}-plain",
                                                      {"aggregation": "mean"})):
                    labels.append(f"{label}={method}")
                    entries[label] = {**options, "inject": inject, **plain}
    return ",".join(labels), entries


#: Named settings. ``shared`` options apply to every method; ``methods`` maps an algorithm
#: or a label to its own options (an algorithm's entry applies to every method of that
#: algorithm, a label's to that method only, in the order listed, so a label's entry after its
#: algorithm's wins); ``algorithms``, where given, is the preset's own ``--algorithms``;
#: ``seeds``, where given, its ``--seeds`` (a ``--seed`` replaces them with one run).
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "about": "the small model (1.3M parameters) on Shakespeare, 4 workers of 4 x 128 "
                 "tokens, 300 steps, H = 30 (10 outer steps), the outer optimizer the "
                 "sweeps chose for so few outer steps (lr 1, no momentum: docs/claims.md): "
                 "the papers' five methods in about 8 minutes on a 2-core CPU",
        "algorithms": "ddp,diloco,streaming,noloco,local",
        "shared": {**CPU_JOB, "model": "small", "steps": 300, "warmup": 30, "eval_every": 50,
                   "log_every": 10},
        "methods": {"diloco": {"sync_every": 30, **FEW_OUTER_STEPS},
                    "noloco": {"sync_every": 30, "spread_every": 10, **FEW_OUTER_STEPS},
                    "streaming": {"sync_every": 30, "fragments": 2, "overlap": "1",
                                  "codec": "fp4_e3m0", **FEW_OUTER_STEPS},
                    "local": {"spread_every": 10}},
    },
    "evidence": {
        "about": "the papers' headline claims tested over 3 seeds in about 30 minutes on a "
                 "2-core CPU: the tiny model (0.16M parameters) on Shakespeare, 4 workers of "
                 "4 x 128 tokens, 900 steps (12 tokens per parameter), H = 30 (30 outer "
                 "steps) with the outer optimizer the sweeps chose (lr 1, no momentum) for "
                 "DiLoCo, Streaming DiLoCo (FP4, and its fp32 twin) and NoLoCo (also in 2 "
                 "pipeline stages with fixed and with random routing), Local and "
                 "DataParallel",
        "algorithms": "ddp,diloco,streaming,streaming-fp32=streaming,noloco,noloco-pp=noloco,"
                      "noloco-routed=noloco,local",
        "seeds": [0, 1, 2],
        "shared": {**CPU_JOB, "model": "tiny", "steps": 900, "warmup": 30, "eval_every": 100,
                   "log_every": 20},
        "methods": {"diloco": {"sync_every": 30, **FEW_OUTER_STEPS},
                    "streaming": {"sync_every": 30, **STREAMING_FP4},
                    "streaming-fp32": {"codec": "fp32"},
                    "noloco": {"sync_every": 30, "spread_every": 10, **FEW_OUTER_STEPS},
                    "noloco-pp": {"stages": 2},
                    "noloco-routed": {"stages": 2, "routing": "random"},
                    "local": {"spread_every": 10}},
    },
    "frontier": {
        "about": "the compression frontier over 3 seeds in about 55 minutes on a 2-core CPU: "
                 "the tiny model on Shakespeare, 4 workers of 4 x 128 tokens, 600 steps; "
                 "DataParallel with AdamW inside and with Muon inside (MuLoCo's twin), "
                 "DiLoCo, Streaming DiLoCo FP4, DiLoCo FP4 with and without error feedback, "
                 "SparseLoCo, DeMo, SPARTA alone and inside DiLoCo, NoLoCo, MuLoCo (DiLoCo "
                 "with Muon inside, 2-bit pseudo-gradients and error feedback), DiLoCo 2-bit "
                 "with and without error feedback, and Local; H = 30 for every method that "
                 "has one, the outer optimizer and inner lr the sweeps chose "
                 "(docs/frontier.md)",
        "algorithms": "ddp,ddp-muon=ddp,diloco,streaming,diloco-fp4=diloco,diloco-fp4-ef=diloco,"
                      "sparseloco,demo,sparta,sparta_diloco,noloco,diloco-2bit=diloco,"
                      "diloco-2bit-ef=diloco,muloco=diloco,local",
        "seeds": [0, 1, 2],
        # lr: the sweep of docs/frontier.md (seed 0): 0.01 was best for DataParallel and
        # DiLoCo with AdamW inside (every AdamW method takes it), and for DeMo; 0.03 for
        # MuLoCo and SparseLoCo. ddp-muon, MuLoCo's twin (claims hold a method against the
        # reference run with its inner optimizer): 0.03, the best of the lead's seed-0 runs
        # (4.443 at 0.03, 4.470 at 0.01; docs/frontier.md), and Muon's own rate 0.01 as
        # MuLoCo's (4.396 at seed 0).
        "shared": {**CPU_JOB, "model": "tiny", "steps": 600, "warmup": 30, "eval_every": 100,
                   "log_every": 20, "lr": 0.01},
        "methods": {"ddp-muon": {"inner_optimizer": "muon", "lr": 0.03, "muon_lr": 0.01},
                    "diloco": {"sync_every": 30, **FEW_OUTER_STEPS},
                    "streaming": {"sync_every": 30, **STREAMING_FP4},
                    "diloco-fp4": {"codec": "fp4_e3m0"},
                    "diloco-fp4-ef": {"codec": "fp4_e3m0", "error_feedback": 0.95},
                    "sparseloco": {"sync_every": 30, "lr": 0.03},
                    "sparta_diloco": {"sync_every": 30, **FEW_OUTER_STEPS},
                    "noloco": {"sync_every": 30, "spread_every": 10, **FEW_OUTER_STEPS},
                    "diloco-2bit": {"codec": "int2"},
                    "diloco-2bit-ef": {"codec": "int2", "error_feedback": 0.95},
                    # muon_lr 0.01: the Muon-rate sweep of docs/frontier.md (seed 0: 0.01
                    # 4.727, 0.02 4.739, 0.03 4.776, 0.06 4.786)
                    "muloco": {"codec": "int2", "error_feedback": 0.95,
                               "inner_optimizer": "muon", "lr": 0.03, "muon_lr": 0.01},
                    "local": {"spread_every": 10}},
    },
    "hetero": {
        "about": "workers of unequal speed over 3 seeds in about 25 minutes on a 2-core CPU: "
                 "the tiny model on Shakespeare, 4 workers at speeds 1, 1, 0.5 and 0.33 "
                 "(--worker-speed), 4 x 128 tokens, 480 steps, H = 20 (24 rounds); "
                 "synchronous DiLoCo, DiLoCo with speed-aware local steps and with "
                 "asynchronous outer steps (S = 2), DiLoCo of 4 equal workers (the tokens "
                 "claim's reference), Streaming DiLoCo (P = 2, FP4) at tau = 1 with and "
                 "without eager updates, and eager at tau = H/P - 1 = 9; and under failures: "
                 "worker 1 dies at step 240 and rejoins (--elastic --fault 1:240:exit), "
                 "asynchronous DiLoCo and DataParallel (docs/unequal.md)",
        "algorithms": "diloco,diloco-aware=diloco,diloco-async=diloco,diloco-even=diloco,"
                      "streaming,streaming-eager=streaming,streaming-eager-late=streaming,"
                      "diloco-async-fail=diloco,ddp-fail=ddp",
        "seeds": [0, 1, 2],
        # processes: an elastic worker is a process of its own (every run, for one launcher)
        "shared": {**CPU_JOB, "model": "tiny", "steps": 480, "warmup": 20, "eval_every": 40,
                   "log_every": 20, "launcher": "processes"},
        "methods": {"diloco": {"sync_every": 20, "worker_speed": "1,1,0.5,0.33",
                               **FEW_OUTER_STEPS},
                    "diloco-aware": {"local_steps": "proportional"},
                    "diloco-async": {"local_steps": "proportional", "max_staleness": 2},
                    "diloco-even": {"worker_speed": None},
                    "streaming": {"sync_every": 20, "worker_speed": "1,1,0.5,0.33",
                                  **STREAMING_FP4},
                    "streaming-eager": {"eager": True},
                    "streaming-eager-late": {"eager": True, "overlap": "9"},
                    "diloco-async-fail": {"local_steps": "proportional", "max_staleness": 2,
                                          **FAILURE},
                    "ddp-fail": {"worker_speed": "1,1,0.5,0.33", **FAILURE}},
    },
    "paper": {
        "about": "the papers' settings at the size of their smaller runs, for one GPU machine "
                 "(bring a large --corpus): the large model (12 layers, d=768, ~88M "
                 "parameters at vocab 4096), M = 4 workers, seq 1024, bf16, z-loss 1e-4; "
                 "DataParallel with bf16 gradients; inner AdamW (0.9, 0.95), wd 0.1, except "
                 "NoLoCo's Adam (0.9, 0.999), wd 0; H = 100 (Streaming: 4 fragments of 3 "
                 "layers, τ = 1, α = 0.5, FP4), NoLoCo H = 50, n = 2; and diloco-hb, the "
                 "NoLoCo paper's DiLoCo baseline (H = 100, heavy-ball momentum 0.3, NoLoCo's "
                 "inner optimizer)",
        "algorithms": "ddp,diloco,diloco-hb=diloco,streaming,noloco,local",
        "shared": {"model": "large", "workers": 4, "steps": 8800, "batch_size": 16,
                   "seq_len": 1024, "dtype": "bf16", "lr": 4e-4, "warmup": 1000,
                   "weight_decay": 0.1, "adam_betas": "0.9,0.95", "z_loss": 1e-4,
                   "eval_every": 500, "eval_batches": 32, "final_eval_batches": 200,
                   "log_every": 50, "comm_timeout": 1800.0},
        "methods": {"ddp": {"grad_codec": "bf16"},
                    "diloco": {"sync_every": 100},
                    # The NoLoCo paper's DiLoCo baseline: its code's heavy-ball outer
                    # momentum 0.3 at H = 100, with NoLoCo's inner optimizer.
                    "diloco-hb": {"sync_every": 100, "nesterov": False, "outer_momentum": 0.3,
                                  "adam_betas": "0.9,0.999", "weight_decay": 0.0},
                    "streaming": {"sync_every": 100, "fragments": 4, "overlap": "1",
                                  "mixing": 0.5, "codec": "fp4_e3m0"},
                    "noloco": {"sync_every": 50, "group_size": 2, "spread_every": 100,
                               "adam_betas": "0.9,0.999", "weight_decay": 0.0},
                    "local": {"spread_every": 100}},
    },
}

_ADVERSARIAL_ALGORITHMS, _ADVERSARIAL_METHODS = attack_plan(
    {"ddp": {}, "diloco": {"sync_every": 20, **FEW_OUTER_STEPS},
     "streaming": {"sync_every": 20, **STREAMING_FP4},
     # loco's first format (runs of 4096, two magnitudes a chunk, the mean over all): the
     # format docs/security.md's SparseLoCo rows were measured with
     "sparseloco": {"sync_every": 20, "lr": 0.03, "sparse_layout": "runs",
                    "sparse_values": "split", "sparse_mean": "all"},
     "demo": {}, "noloco": {"sync_every": 20, **FEW_OUTER_STEPS}},
    proportional=("diloco", "streaming", "sparseloco"))

PRESETS["adversarial"] = {
    "about": "every attack of --inject against every method, in about 20 minutes on a "
             "2-core CPU: the tiny model on Shakespeare, 4 workers of 4 x 128 tokens, 160 "
             "steps, H = 20 (8 outer steps; lr 0.01, SparseLoCo's 0.03); DataParallel, "
             "DiLoCo, Streaming DiLoCo FP4, SparseLoCo, DeMo and NoLoCo, each clean, then "
             "with worker 1 attacking from the first step (scale=-50, noise=1, nan, "
             "bitflip=64, stale=2, zero; lie-tokens=10 with proportional local steps, against "
             "a clean run of proportional local steps, for the three methods that take "
             "them) under the default guard and under plain averaging (METHOD-ATTACK-plain); "
             "silent is left out: it needs an elastic run (docs/security.md)",
    "algorithms": _ADVERSARIAL_ALGORITHMS,
    # A plain mean that meets a NaN skips that step or sync (and counts it) instead of
    # stopping the comparison; the guarded runs never see one unless the guard misses it.
    "shared": {**CPU_JOB, "model": "tiny", "steps": 160, "warmup": 20, "eval_every": 80,
               "log_every": 20, "lr": 0.01, "on_nonfinite": "skip"},
    "methods": _ADVERSARIAL_METHODS,
}
