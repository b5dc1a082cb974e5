"""A loco model as an lm-evaluation-harness ``TemplateLM``: log-likelihoods of
continuations, rolling log-likelihoods, greedy generation."""

from __future__ import annotations

import functools
from typing import Any

import torch
from tqdm import tqdm


def eot_token_id(tokenizer) -> int:
    """The tokenizer's end-of-text token: the first of ``loco.data.EOS_NAMES`` it has
    (``<|endoftext|>`` for loco's own), else 0."""
    from loco import data

    for name in getattr(data, "EOS_NAMES", (data.ENDOFTEXT,)):
        token = tokenizer.token_to_id(name)
        if token is not None:
            return token
    return 0


class _TemplateMethods:
    """``LocoLM``'s own methods: a loco model (``forward(idx) -> logits``) and its
    ``tokenizers.Tokenizer``, as lm-eval's ``TemplateLM`` wants them; :func:`lm_class` puts
    ``TemplateLM`` under them (lm-eval is imported on first use only)."""

    def __init__(self, model, tokenizer, max_length: int, batch_size: int = 16,
                 device: str | torch.device = "cpu", description: str = "",
                 eot_id: int | None = None):
        super().__init__()
        self.model = model.to(device).eval()
        self.tokenizer_ = tokenizer
        self._max_length = max_length
        self.batch_size = batch_size
        self._device = torch.device(device)
        self.description = description
        self._eot = eot_token_id(tokenizer) if eot_id is None else eot_id
        self.truncated = 0

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        return self.tokenizer_.encode(string, add_special_tokens=bool(
            add_special_tokens)).ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_.decode(list(tokens))

    def get_model_info(self) -> dict:
        return {"model": "loco", "model_description": self.description,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "max_length": self._max_length}

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(log P(continuation | context), whether it is the greedy continuation) of
        every (key, context tokens, continuation tokens): the context is cut on the
        left to fit ``max_length`` tokens of input; a continuation longer than that is
        scored on its last ``max_length`` tokens (counted in ``truncated``)."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self._max_length + 1):]
            scored = min(len(continuation), len(whole) - 1)
            if scored < len(continuation):
                self.truncated += 1
            rows.append((whole[:-1], whole[len(whole) - scored:]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        batches = [order[i:i + self.batch_size]
                   for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, disable=disable_tqdm or len(batches) < 2,
                          desc="loco eval", leave=False):
            width = len(rows[batch[0]][0])
            x = torch.zeros(len(batch), width, dtype=torch.long)
            for b, i in enumerate(batch):
                x[b, :len(rows[i][0])] = torch.tensor(rows[i][0])
            logp = torch.log_softmax(self.model(x.to(self.device)).float(), dim=-1).cpu()
            for b, i in enumerate(batch):
                inputs, targets = rows[i]
                if not targets:
                    results[i] = (0.0, True)
                    continue
                n = len(inputs)
                target = torch.tensor(targets)
                rowlogp = logp[b, n - len(targets):n]
                ll = rowlogp.gather(-1, target[:, None]).sum().item()
                greedy = bool((rowlogp.argmax(-1) == target).all())
                results[i] = (ll, greedy)
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, (ll, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in windows of ``max_length`` tokens (lm-eval's
        rolling windows, each predicting new tokens only)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="loco eval rolling",
                            leave=False):
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows],
                                                disable_tqdm=True)
            total = sum(ll for ll, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation (sampling options are ignored) until a stop string of
        ``until``, the end-of-text token or ``max_gen_toks`` tokens (default 256); the
        context is cut on the left to ``max_length`` tokens at every step."""
        out = []
        for request in tqdm(requests, disable=disable_tqdm, desc="loco eval generate",
                            leave=False):
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tok_encode(context) or [self.prefix_token_id]
            generated: list[int] = []
            text = ""
            for _ in range(int(kwargs.get("max_gen_toks", 256))):
                window = (ids + generated)[-self._max_length:]
                logits = self.model(torch.tensor([window], device=self.device))
                token = int(logits[0, -1].argmax())
                if token == self._eot:
                    break
                generated.append(token)
                text = self.tok_decode(generated)
                if any(u and u in text for u in until):
                    break
            for u in until:
                if u:
                    text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, kwargs), text)
            out.append(text)
        return out


@functools.cache
def lm_class() -> type:
    """``LocoLM``, an ``lm_eval.api.model.TemplateLM`` over a loco model (lm-eval is
    imported on first use); build one with :func:`make_lm`."""
    from lm_eval.api.model import TemplateLM

    return type("LocoLM", (_TemplateMethods, TemplateLM), {
        "__module__": __name__,
        "__doc__": "A loco model and its tokenizer, as lm-eval's TemplateLM."})


def make_lm(model: torch.nn.Module, tokenizer: Any, max_length: int, batch_size: int = 16,
            device: str | torch.device = "cpu", description: str = "",
            eot_id: int | None = None):
    """An lm-evaluation-harness model (``TemplateLM``) over a loco model.

    Args:
        model: a module whose ``forward(idx)`` returns logits ``(batch, seq, vocab)``.
        tokenizer: its ``tokenizers.Tokenizer``.
        max_length: the most tokens of input per forward pass (the run's ``--seq-len``).
        batch_size: sequences per forward pass; default 16.
        device: where to run; default ``"cpu"``.
        description: which model this is, for lm-eval's results; default empty.
        eot_id: the end-of-text token, the context of an empty context (the corpus's
            ``eos_id``, which separated its documents); default None:
            :func:`eot_token_id`.
    """
    return lm_class()(model, tokenizer, max_length, batch_size, device, description, eot_id)
