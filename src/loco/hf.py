"""Hugging Face causal language models as loco models: ``--model hf:PATH``.

PATH is a local directory with a ``config.json`` and, optionally, the model's weights
(``model.safetensors``, ``pytorch_model.bin`` or their sharded index), loaded from there,
never from a hub. Without weights the model is built from the config on the meta device,
with the tokenizer's vocabulary, and drawn from the run's seed when it is materialised
(whole, or each rank its FSDP2 shard: the same bits either way; see
[`HFCausalLM.init_weights`][loco.hf.HFCausalLM.init_weights]).
[`HFCausalLM`][loco.hf.HFCausalLM] gives it loco's model
interface; its decoder layers (the largest ``nn.ModuleList``) are the blocks of fragments
and FSDP2 units, and Llama architectures split into pipeline stages. Dropout is off (the
threads launcher's workers share torch's global generator); see docs/hugging-face.md.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from loco.model import StagedModel, StagePart, local_rows, materialise, normal_rows, token_loss

PREFIX = "hf:"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")
INSTALL = "pip install 'loco[hf]'"
STAGE_ARCHITECTURES = ("llama",)
"""model_type values whose models pipeline stages split (with untied input and output
embeddings, as Llama's configs have them)."""
# Building from a config patches nn.Module.register_parameter process-wide
# (`_parameters_on_meta`); threads of one process build one at a time.
_BUILD = threading.Lock()


class HFModelError(ValueError):
    """A ``--model hf:PATH`` that cannot be used; the message is one line for the user."""


def is_hf(model: str) -> bool:
    """Whether a ``--model`` value names a Hugging Face model (``hf:PATH``).

    Args:
        model: the ``--model`` value.
    """
    return model.startswith(PREFIX)


def model_dir(model: str) -> Path:
    """The directory a ``hf:PATH`` value names. A relative PATH that does not exist here is
    also looked up in the loco checkout, so ``hf:configs/llama-35m`` works from any directory
    of an editable install.

    Args:
        model: the ``--model`` value, ``hf:PATH``.
    """
    path = Path(model[len(PREFIX):]).expanduser()
    checkout = Path(__file__).resolve().parents[2] / path
    if not path.exists() and not path.is_absolute() and checkout.exists():
        return checkout
    return path


def _transformers():
    try:
        import transformers
    except ImportError:
        raise HFModelError(f"--model hf:... needs transformers: {INSTALL}") from None
    return transformers


def load_config(model: str):
    """The ``transformers`` config of a ``hf:PATH`` model, checked to be a causal LM.

    Args:
        model: the ``--model`` value, ``hf:PATH``.

    Raises:
        HFModelError: no such directory, no ``config.json``, or not a causal language model.
    """
    path = model_dir(model)
    if not path.is_dir():
        raise HFModelError(f"{path} is not a directory (hf:PATH needs a directory with a "
                           "config.json)")
    if not (path / "config.json").is_file():
        raise HFModelError(f"{path} has no config.json")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HFModelError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = raw.get("model_type")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise HFModelError(f"{path / 'config.json'}: model_type {kind!r} is not a causal "
                           "language model architecture transformers knows (e.g. llama, gpt2, "
                           "mistral, qwen2)")
    return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)


def has_weights(model: str) -> bool:
    """Whether the ``hf:PATH`` directory holds weights (then they are loaded).

    Args:
        model: the ``--model`` value, ``hf:PATH``.
    """
    return any((model_dir(model) / name).is_file() for name in WEIGHTS)


def num_layers(config: Any) -> int:
    """The decoder layers of a ``transformers`` config (``num_hidden_layers``).

    Args:
        config: a ``transformers.PretrainedConfig``.
    """
    return int(config.num_hidden_layers)


def max_positions(config: Any) -> int | None:
    """The longest sequence the config's position embeddings allow (None: not stated).

    Args:
        config: a ``transformers.PretrainedConfig``.
    """
    return getattr(config, "max_position_embeddings", None)


def _no_dropout(config) -> None:
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(config, key, 0.0)


def _set_vocab(config, vocab_size: int) -> None:
    """A fresh model's vocabulary is the tokenizer's; special ids beyond it are dropped (they
    only matter to generation, which training does not use)."""
    config.vocab_size = vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= vocab_size:
            setattr(config, key, None)


class HFCausalLM(nn.Module, StagedModel):
    """A ``transformers`` causal LM with loco's model interface.

    Args:
        model: an ``AutoModelForCausalLM`` instance (its parameters are named ``hf.*``).
        z_loss: coefficient of the z-loss on the log-partition function; default 0.
        seed: the seed [`init_weights`][loco.hf.HFCausalLM.init_weights] draws from;
            default 0.
    """

    def __init__(self, model: nn.Module, z_loss: float = 0.0, seed: int = 0):
        super().__init__()
        self.hf = model
        self.z_loss = z_loss
        self.seed = seed

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw every parameter, or this rank's shard of it (FSDP2, dimension 0), from
        ``seed``, by the model's own rules. The weights of every Linear, GPT-2 Conv1D and
        Embedding are normal(0, ``initializer_range``) (an Embedding's ``padding_idx`` row
        zeros), drawn in per-parameter seeded blocks of rows (``loco.model.normal_rows``,
        keyed by the parameter's name here, ``hf.…``), so that any sharding gives the
        unsharded model's bits; their biases are zeros; a tied parameter is drawn once. Any
        other module's parameters (norms: ones, or Gemma's zeros) are set by the model's own
        ``_init_weights``, which must not draw random numbers. Model-specific rescalings of
        the matrices (GPT-2's of ``c_proj``) are not applied. Buffers are left as they are.

        Raises:
            HFModelError: the model's own init of a module draws random numbers (it could
                not be sharded).
        """
        from transformers.pytorch_utils import Conv1D

        std = getattr(self.hf.config, "initializer_range", None) or 0.02
        owners: dict[int, tuple[nn.Module, str]] = {}
        for module in self.modules():
            for pname, p in module.named_parameters(recurse=False):
                owners.setdefault(id(p), (module, pname))
        others: dict[int, nn.Module] = {}
        for name, p in self.named_parameters():
            module, pname = owners[id(p)]
            local, first = local_rows(p)
            if not isinstance(module, (nn.Linear, nn.Embedding, Conv1D)):
                others[id(module)] = module
            elif pname == "weight":
                normal_rows(local, first, p.shape[0], std, self.seed, name)
                pad = getattr(module, "padding_idx", None)
                if pad is not None and first <= pad < first + local.shape[0]:
                    local[pad - first].zero_()
            else:
                local.zero_()
        for module in others.values():
            before = torch.random.get_rng_state()
            self.hf._init_weights(module)
            if not torch.equal(before, torch.random.get_rng_state()):
                raise HFModelError(f"the model's own init of its {type(module).__name__} "
                                   "draws random numbers: loco cannot draw it shard by shard")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``, or with ``targets`` the mean token loss.

        Args:
            idx: token ids ``(batch, seq)``.
            targets: the next-token ids ``(batch, seq)``; default None.
        """
        logits = self.hf(input_ids=idx, use_cache=False).logits
        return logits if targets is None else token_loss(logits, targets, self.z_loss)

    def num_parameters(self) -> int:
        """Parameters, each tensor once (tied embeddings count once)."""
        return sum(p.numel() for p in self.parameters())

    def stage_part(self, stage: int, stages: int) -> LlamaStage:
        """The part of this model pipeline stage ``stage`` of ``stages`` owns (see
        [`LlamaStage`][loco.hf.LlamaStage]): the model's
        [`StagedModel`][loco.model.StagedModel] interface, for Llama architectures with
        untied embeddings ([`splits_into_stages`][loco.hf.splits_into_stages]).

        Args:
            stage: the stage, in [0, stages).
            stages: S, in [1, the model's number of decoder layers].

        Raises:
            ValueError: ``stages`` out of range.
        """
        return LlamaStage(self, stage, stages)


def build(model: str, vocab_size: int, seed: int, z_loss: float = 0.0,
          device: torch.device | str = "cpu") -> HFCausalLM:
    """The ``hf:PATH`` model in fp32 on ``device``: its weights when the directory has them
    (loaded on the CPU), else a fresh one from its config with ``vocab_size`` tokens, built
    on the meta device (its buffers, the rotary tables, real) and materialised, drawn from
    ``seed`` (see [`HFCausalLM.init_weights`][loco.hf.HFCausalLM.init_weights]).

    Args:
        model: the ``--model`` value, ``hf:PATH``.
        vocab_size: the tokenizer's vocabulary size.
        seed: the seed of a fresh model's weights.
        z_loss: the z-loss coefficient; default 0.
        device: where to put it; default the CPU; ``"meta"``: a fresh model is left on the
            meta device, to be sharded and then materialised (``loco.model.materialise``),
            and a model with weights stays on the CPU.

    Raises:
        HFModelError: an unusable directory, or a tokenizer whose ids do not fit the weights.
    """
    config = load_config(model)
    _no_dropout(config)
    transformers = _transformers()
    if has_weights(model):
        check_vocab(model, config, vocab_size)
        transformers.utils.logging.disable_progress_bar()  # one per worker: noise
        with _BUILD:
            net = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir(model)), config=config, local_files_only=True,
                dtype=torch.float32, attn_implementation="sdpa")
        lm = HFCausalLM(net.train(), z_loss, seed)
        return lm if str(device) == "meta" else lm.to(device)
    _set_vocab(config, vocab_size)
    with _BUILD, _parameters_on_meta():
        net = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa")
    lm = HFCausalLM(net.train(), z_loss, seed)
    return lm if str(device) == "meta" else materialise(lm, device)


@contextmanager
def _parameters_on_meta():
    """Modules built inside, by this thread, put their parameters on the meta device as
    they register them, their buffers (computed in ``__init__``, such as rotary tables)
    staying real. Other threads' modules are left alone."""
    register, builder = nn.Module.register_parameter, threading.get_ident()

    def on_meta(module, name, param):
        register(module, name, param)
        if (threading.get_ident() == builder and param is not None
                and not param.is_meta):  # (a tied one is already)
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def check_vocab(model: str, config: Any, vocab_size: int) -> None:
    """Raise when a tokenizer of ``vocab_size`` ids does not fit a model's trained vocabulary.

    Args:
        model: the ``--model`` value, ``hf:PATH``.
        config: its ``transformers`` config.
        vocab_size: the tokenizer's vocabulary size.
    """
    if vocab_size > config.vocab_size:
        raise HFModelError(f"vocabulary mismatch: the tokenizer has {vocab_size} tokens but "
                           f"the weights in {model_dir(model)} have {config.vocab_size}; give "
                           "the model's own tokenizer with --tokenizer")


def parameter_count(model: str, vocab_size: int) -> int:
    """The parameters of the ``hf:PATH`` model at ``vocab_size``, counted on the meta device
    (nothing allocated).

    Args:
        model: the ``--model`` value, ``hf:PATH``.
        vocab_size: the tokenizer's vocabulary size (a fresh model's; weights keep theirs).
    """
    config = load_config(model)
    if not has_weights(model):
        _set_vocab(config, vocab_size)
    with torch.device("meta"):
        net = _transformers().AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in net.parameters())


def splits_into_stages(config: Any) -> bool:
    """Whether pipeline stages can split models of this config: a Llama architecture
    (``STAGE_ARCHITECTURES``) with untied input and output embeddings.

    Args:
        config: a ``transformers.PretrainedConfig``.
    """
    return config.model_type in STAGE_ARCHITECTURES and not config.tie_word_embeddings


class LlamaStage(StagePart):
    """The part of a Hugging Face Llama model one pipeline stage owns: the token embedding
    on the first stage, its run of decoder layers, the final norm and the output head on the
    last. Parameters keep the model's names (``hf.model.layers.3.mlp.up_proj.weight``); the
    rotary tables are recomputed on every stage from the positions. The decoder layers get
    no attention mask: the model is built with SDPA attention, which is then causal, as the
    whole model's forward is without padding.

    Args:
        model: the whole model, whose modules are shared.
        stage: this part's stage, in [0, stages).
        stages: S, in [1, the model's number of decoder layers].
    """

    def __init__(self, model: HFCausalLM, stage: int, stages: int):
        inner = model.hf.model
        super().__init__(stage, stages, len(inner.layers), model.hf.config.hidden_size,
                         model.z_loss)
        start, stop = self.block_range
        self.hf = nn.Module()
        self.hf.model = nn.Module()
        if self.is_first:
            self.hf.model.embed_tokens = inner.embed_tokens
        self.hf.model.layers = nn.ModuleDict({str(i): inner.layers[i]
                                              for i in range(start, stop)})
        if self.is_last:
            self.hf.model.norm = inner.norm
            self.hf.lm_head = model.hf.lm_head
        self._rotary = (inner.rotary_emb,)  # a tuple keeps its buffer out of this module's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's part of the forward pass.

        Args:
            x: token ids ``(batch, seq)`` on stage 0, activations ``(batch, seq, hidden)``
                on later stages.

        Returns:
            Activations, or on the last stage logits ``(batch, seq, vocab)``.
        """
        h = self.hf.model.embed_tokens(x) if self.is_first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self._rotary[0](h, position_ids=positions)
        for layer in self.hf.model.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions,
                      position_embeddings=rotary)
        if self.is_last:
            h = self.hf.lm_head(self.hf.model.norm(h))
        return h
