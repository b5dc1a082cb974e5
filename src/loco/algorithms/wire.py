"""The options of the methods that keep a global copy (DiLoCo and its kin): the copy's place,
the pseudo-gradients' wire format and its error feedback, their checks and report words."""

from __future__ import annotations

from dataclasses import dataclass

from loco.comm.formats import CHUNK_TOPK_CODEC_NAMES, CODEC_NAMES
from loco.options import need, opt


@dataclass
class GlobalCopyOptions:
    """The options of a method that keeps a global copy apart from the replicas (DiLoCo)."""

    eval_replicas: bool = opt(False, "diloco, streaming: at the end also evaluate every "
                              "replica and the replicas' average, next to the global model "
                              "(the Streaming DiLoCo paper's Table 3); every worker evaluates "
                              "(noloco and local always do)")
    offload: bool = opt(False, "keep the global copy and outer optimizer state in CPU memory "
                        "(diloco, streaming)")
    eager: bool = opt(False, "eager updates (diloco, streaming; Kale et al. 2025): take the "
                      "outer step when a sync is sent, with this worker's fresh "
                      "pseudo-gradient as its share of the average and the other workers' "
                      "from the previous sync; the average only has to arrive before the "
                      "next sync (diloco: it overlaps the whole round)")


@dataclass
class WireOptions(GlobalCopyOptions):
    """The wire format of a method that all-reduces pseudo-gradients (DiLoCo, Streaming
    DiLoCo, SparseLoCo), and its error feedback."""

    codec: str | None = opt(None, "wire format of the pseudo-gradients (diloco, streaming, "
                            "sparseloco); the reduction itself is fp32 (default: the "
                            "method's: diloco fp32, streaming fp4_e3m0, sparseloco topk_2bit)",
                            CODEC_NAMES)
    codec_keep: float | None = opt(None, "share of the values the sparse codecs send, in "
                                   "(0, 1]: of each row for topk, dare, random_drop (default "
                                   "1/8, the bytes of 4 bits per value), of each chunk for "
                                   "topk_2bit (default 1/64: 64 of 4096, SparseLoCo's)")
    codec_block: int | None = opt(None, "values per power-of-two scale of the 8-, 4- and 2-bit "
                                  "codecs (default 32; larger blocks send fewer scale bytes "
                                  "but clip less evenly), or per chunk of topk_2bit (default "
                                  "4096)")
    error_feedback: float | None = opt(None, "beta of the error feedback (diloco, streaming, "
                                       "sparseloco), in [0, 1): each worker keeps what its "
                                       "codec did not send, e <- beta e + delta, sends C(e) "
                                       "and keeps e - D(C(e)); 0: none (default: the "
                                       "method's: diloco and streaming 0, sparseloco 0.95)")


def check_wire(cfg) -> None:
    """The wire options' ranges: keep in (0, 1], the block in [2, 65536] (even for 4 bits,
    a multiple of 4 for int2), error feedback's beta in [0, 1); eager updates not elastic.

    Raises:
        ConfigError: naming the first option out of range.
    """
    if cfg.codec_keep is not None:
        need(cfg, 0 < cfg.codec_keep <= 1, "codec_keep", "must be in (0, 1]")
    if cfg.codec_block is not None:
        per_byte = {"fp4_e3m0": 2, "fp4_e2m1": 2, "int2": 4}.get(cfg.codec, 1)
        need(cfg, 2 <= cfg.codec_block <= 65536 and cfg.codec_block % per_byte == 0,
             "codec_block", "must be an integer in [2, 65536]"
             + (f" and a multiple of {per_byte} with --codec {cfg.codec}" if per_byte > 1
                else ""))
    need(cfg, 0 <= cfg.error_feedback < 1, "error_feedback", "must be in [0, 1) (0: none)")
    need(cfg, not (cfg.eager and cfg.elastic), "eager", "needs a fixed group of workers (a "
         "worker's share is 1/M): leave out --elastic")


def wire_warnings(cfg) -> list[str]:
    """Error feedback on a lossless wire, or a top-k chunk format without it."""
    if cfg.error_feedback and cfg.codec == "fp32":
        return ["--error-feedback has nothing to feed back with --codec fp32 (lossless)"]
    if not cfg.error_feedback and cfg.codec in CHUNK_TOPK_CODEC_NAMES:
        return [f"--codec {cfg.codec} without --error-feedback: the values it does not send "
                "are lost (SparseLoCo keeps them, beta 0.95)"]
    return []


def wire_setting(config: dict) -> str:
    """The report's words for the codec and the error feedback, ``", ..."``."""
    beta = config.get("error_feedback") or 0
    return f", {config.get('codec') or 'fp32'}" + (f", error feedback β={beta:g}" if beta else "")


__all__ = ["GlobalCopyOptions", "WireOptions", "check_wire", "wire_setting", "wire_warnings"]
