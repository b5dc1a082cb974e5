"""The casts ``fp32`` and ``bf16``: the values' own bytes, no scales."""

from __future__ import annotations

import torch

from loco.comm.codecs.contract import Codec


class CastCodec(Codec):
    """fp32 / bf16: the values' own bytes, no scales."""

    blockwise = True

    def __init__(self, name: str, dtype: torch.dtype):
        super().__init__(name)
        self.dtype = dtype

    def _encode_rows(self, x):
        # copy=True: the wire buffer must never alias the caller's tensor
        return x.to(self.dtype, copy=True).contiguous().view(torch.uint8)

    def _check_buf(self, buf, c):
        buf = super()._check_buf(buf, c)
        if not buf.is_contiguous() or buf.storage_offset() % (self.bits // 8):
            buf = buf.clone(memory_format=torch.contiguous_format)  # a slice of a message
        return buf

    def _decode_rows(self, buf, c):
        values = buf.view(-1).view(self.dtype)  # 1-D view: also fine when empty
        return values.to(torch.float32, copy=True).view(buf.shape[0], c)

    def _encode_rows_into(self, x, out):  # one pass, eager too: the cast is the copy
        out.view(-1).view(self.dtype).view(x.shape).copy_(x)
        return out

    def _decode_rows_into(self, buf, c, out):
        return out.copy_(buf.view(-1).view(self.dtype).view(buf.shape[0], c))
