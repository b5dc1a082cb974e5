"""How much each wire format distorts a real pseudo-gradient, and what it costs on the wire.

Trains the model single-process with the training's AdamW and schedule for --warm-steps,
snapshots the parameters, trains --sync-every more steps and forms the pseudo-gradient
Δ = θ_snapshot − θ_now of all parameters (one flat fp32 vector, as one DiLoCo sync would
send). Then round-trips Δ through every codec and prints, per codec:

* rel L2: ||dec(enc(Δ)) − Δ|| / ||Δ||;  cosine: cos(dec(enc(Δ)), Δ);
* max err: max |dec(enc(Δ)) − Δ| / max |Δ|;
* zeroed: the share of Δ's nonzero elements that decode to exactly 0;
* bits/value on the wire (scales included) and the bytes ratio fp32 / this;
* encode + decode milliseconds for the whole Δ (best of a few repeats).

A second table sweeps the block size of the two 4-bit codecs.

    python benchmarks/codecs.py                      # small model, 100 + 50 steps, block 32
    python benchmarks/codecs.py --model tiny --warm-steps 20 --sync-every 10
"""

from __future__ import annotations

import argparse
import time

import torch

from loco.comm.codecs import CODEC_NAMES, get_codec
from loco.config import TrainConfig
from loco.data import TokenLoader, prepare_corpus
from loco.model import Transformer, model_config
from loco.training import adamw, lr_lambda

SWEEP_CODECS = ("fp4_e3m0", "fp4_e2m1")
SWEEP_BLOCKS = (16, 32, 64, 128, 256)
TIMING_REPEATS = 3


def pseudo_gradient(args) -> torch.Tensor:
    """Δ = θ after --warm-steps minus θ after --sync-every more steps, flat fp32."""
    corpus = prepare_corpus("shakespeare", 4096, 0.05, None, "text")
    cfg = TrainConfig(steps=args.warm_steps + args.sync_every, model=args.model, seed=args.seed,
                      batch_size=args.batch_size, seq_len=args.seq_len)
    model = Transformer(model_config(cfg.model.name, corpus.vocab_size, cfg.data.seq_len),
                        torch.Generator().manual_seed(cfg.run.seed))
    optimizer = adamw(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    loader = TokenLoader(corpus.train, cfg.data.batch_size, cfg.data.seq_len, seed=cfg.run.seed)

    def train(steps: int) -> float:
        loss = torch.tensor(float("nan"))
        for _ in range(steps):
            x, y = loader.next_batch()
            loss = model(x, y)
            loss.backward()
            if cfg.optim.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])

    t0 = time.perf_counter()
    loss = train(args.warm_steps)
    snapshot = flat()
    loss = train(args.sync_every)
    print(f"trained {args.model} ({model.num_parameters():,} parameters) for {args.warm_steps} + "
          f"{args.sync_every} steps of {cfg.data.batch_size} x {cfg.data.seq_len} tokens in "
          f"{time.perf_counter() - t0:.1f}s, last train loss {loss:.3f}")
    return snapshot - flat()


def round_trip(codec, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Decoded values, the wire bytes and the best encode + decode time in ms."""
    best = float("inf")
    for _ in range(TIMING_REPEATS):
        t0 = time.perf_counter()
        buf = codec.encode(delta)
        out = codec.decode(buf, delta.shape)
        best = min(best, time.perf_counter() - t0)
    return out, buf, best * 1e3


def errors(delta: torch.Tensor, out: torch.Tensor) -> dict:
    d, o = delta.double(), out.double()
    err = o - d
    nonzero = d != 0
    return {"rel_l2": (err.norm() / d.norm()).item(),
            "cosine": torch.nn.functional.cosine_similarity(o, d, dim=0).item(),
            "max_err": (err.abs().max() / d.abs().max()).item(),
            "zeroed": ((o == 0) & nonzero).sum().item() / max(1, nonzero.sum().item())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-steps", type=int, default=100, help="inner steps before the "
                    "snapshot (past the 50-step warm-up, so Δ is a mid-training one)")
    ap.add_argument("--sync-every", type=int, default=50, help="H: inner steps between the "
                    "snapshot and the pseudo-gradient")
    ap.add_argument("--block", type=int, default=32, help="values per scale of the scaled "
                    "codecs in the main table")
    ap.add_argument("--model", default="small", help="model size (tiny, small, medium, ...)")
    ap.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per inner step")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    args = ap.parse_args()

    torch.set_flush_denormal(True)  # as in training: decoded values below 2^-126 become 0
    delta = pseudo_gradient(args)
    n = delta.numel()
    print(f"pseudo-gradient: {n:,} values, ||Δ|| = {delta.norm():.4g}, max |Δ| = "
          f"{delta.abs().max():.4g}, exactly zero: {(delta == 0).sum().item():,}")

    print(f"\ncodecs at block {args.block} (fp32 and bf16 have no block)")
    print(f"{'codec':9} {'rel L2':>9} {'cosine':>9} {'max err':>9} {'zeroed':>8} "
          f"{'bits/val':>8} {'fp32/this':>9} {'enc+dec ms':>10}")
    for name in CODEC_NAMES:
        codec = get_codec(name, args.block)
        out, _, ms = round_trip(codec, delta)
        e = errors(delta, out)
        bits = 8 * codec.encoded_nbytes(n) / n
        print(f"{name:9} {e['rel_l2']:9.2e} {e['cosine']:9.6f} {e['max_err']:9.2e} "
              f"{e['zeroed']:8.2%} {bits:8.3f} {32 / bits:8.2f}x {ms:10.1f}")

    print("\n4-bit codecs by block size: rel L2 error (bits/value)")
    print(f"{'codec':9} " + " ".join(f"{f'block {b}':>16}" for b in SWEEP_BLOCKS))
    for name in SWEEP_CODECS:
        cells = []
        for block in SWEEP_BLOCKS:
            codec = get_codec(name, block)
            out = codec.decode(codec.encode(delta), delta.shape)
            bits = 8 * codec.encoded_nbytes(n) / n
            cells.append(f"{errors(delta, out)['rel_l2']:.4f} ({bits:.3f})")
        print(f"{name:9} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
