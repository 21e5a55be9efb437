"""A small, offline, deterministic Qwen3-architecture causal LM for tests and CPU demos.

Two architectures (:class:`TinyModel`): the dense Qwen3 (the default), and a Qwen3-MoE with
:data:`TINY_MOE_CONFIG`'s experts (8 per layer, 2 routed per token), the same tokenizer and
warm-up. A model setting naming one (``TRAINER_MODEL=tiny-moe``, ``app.py --model tiny-moe``)
builds it (:func:`model_or_default`).

Nothing here downloads anything: the weights are initialised from a seed and the
tokenizer is a character-level vocabulary built with the ``tokenizers`` library.
The folder written by :func:`build_tiny_model` is a normal Hugging Face model
folder (``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that both ``transformers`` and
vLLM can load.

Prompt format (no chat template): the prompt is plain text such as
``"reverse 3817 ="``; the tokenizer prepends ``<s>`` (BOS) when
``add_special_tokens=True`` (the default in ``transformers`` and vLLM), the model
continues with the answer and ends it with ``</s>`` (EOS)::

    <s>reverse 3817 =7183</s>

Optionally (``warmup_steps > 0``; :func:`tiny_model_path` does it by default)
the random model gets a short, seeded supervised warm-up on environment tasks
before it is saved. The random model almost never emits digits or EOS, so its
reward is ~0 and RL has no signal; a full-format-but-content-free warm-up (targets
with scrambled digits, ``answer_fraction=0``) gives it the format but RL on
``reverse`` then still did not improve within 4 minutes on 2 cores. The default
therefore stops a short supervised run early (:data:`DEFAULT_WARMUP`): the model
is partly right, and RL visibly raises the reward within a few minutes.

The warm-up data comes from the caller: ``environments`` maps an environment name
to an object whose ``tasks(n, seed=...)`` returns tasks with ``prompt`` and
``answer`` (the env Space's registry, :func:`env_space.environments.get_environment`),
so this module knows no Space.

Example:
    >>> from env_space.environments import get_environment
    >>> from rlsync.spaces.tiny_model import tiny_model_path
    >>> path = tiny_model_path(environments=get_environment)  # built once, then reused from the cache
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import process_settings

logger = logging.getLogger(__name__)

#: Environment name -> an environment whose ``tasks(n, seed=...)`` returns tasks with
#: ``prompt`` and ``answer`` (e.g. :func:`env_space.environments.get_environment`).
EnvironmentLookup = Callable[[str], Any]

#: Bump when the build procedure changes in a way that changes the produced bytes.
BUILD_VERSION = 1

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

#: Every ordinary character the tokenizer knows, one token each (ids follow the specials).
CHARACTERS: str = "0123456789+-*/=?.,:;!'() \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

#: Architecture of the tiny model (``transformers.Qwen3Config`` keyword arguments,
#: without the vocabulary and special-token ids, which come from the tokenizer).
TINY_MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
}


#: The MoE variant (``transformers.Qwen3MoeConfig`` keyword arguments): every layer's MLP is 8
#: experts of :data:`TINY_MODEL_CONFIG`'s width, 2 routed per token; sizes vLLM's CPU MoE kernels
#: and 128x128 FP8 blocks take (multiples of 128).
TINY_MOE_CONFIG: dict[str, Any] = {
    **TINY_MODEL_CONFIG,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


class TinyModel(str, enum.Enum):
    """The built-in offline models, by the name a model setting gives them."""

    DENSE = "tiny"
    MOE = "tiny-moe"

    @property
    def base_config(self) -> dict[str, Any]:
        """The architecture's config keyword arguments."""
        return TINY_MOE_CONFIG if self is TinyModel.MOE else TINY_MODEL_CONFIG


@dataclasses.dataclass(frozen=True)
class WarmupSettings:
    """Settings of the seeded format warm-up done at build time.

    Attributes:
        steps: Optimizer steps; ``0`` disables the warm-up.
        batch_size: Sequences per step.
        lr: AdamW learning rate.
        environments: Names of registered environments whose prompts are used;
            steps cycle through them (repeat a name to give it more steps).
        answer_fraction: Probability that a target is the reference answer; the
            other targets are the answer with every digit replaced by a random
            digit (right format, uninformative content). ``0`` teaches only the
            format, ``1`` is plain supervised fine-tuning.
    """

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    environments: tuple[str, ...] = ("reverse", "arithmetic")
    answer_fraction: float = 1.0


def vocabulary() -> dict[str, int]:
    """Return the tokenizer vocabulary (token -> id): special tokens first, then characters."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    if len(set(tokens)) != len(tokens):
        raise AssertionError("duplicate tokens in the tiny vocabulary")
    return {tok: i for i, tok in enumerate(tokens)}


def tiny_model_config(kind: TinyModel = TinyModel.DENSE, **overrides: Any):
    """Build the ``transformers`` config of the tiny model.

    Args:
        kind: The architecture.
        **overrides: Keys of its config (:data:`TINY_MODEL_CONFIG`, :data:`TINY_MOE_CONFIG`) to change.

    Returns:
        A ``Qwen3Config`` (``Qwen3MoeConfig``) whose vocabulary and special ids match the tiny tokenizer.

    Raises:
        KeyError: An override names an unknown key.
    """
    from transformers import Qwen3Config, Qwen3MoeConfig

    unknown = set(overrides) - set(kind.base_config)
    if unknown:
        raise KeyError(f"unknown tiny-model config keys: {sorted(unknown)}")
    vocab = vocabulary()
    kwargs = {**kind.base_config, **overrides}
    return (Qwen3MoeConfig if kind is TinyModel.MOE else Qwen3Config)(
        vocab_size=len(vocab),
        pad_token_id=vocab[PAD_TOKEN],
        bos_token_id=vocab[BOS_TOKEN],
        eos_token_id=vocab[EOS_TOKEN],
        dtype="bfloat16",
        **kwargs,
    )


def build_tokenizer():
    """Build the character-level tokenizer.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` that maps each character of
        :data:`CHARACTERS` to one token, prepends ``<s>`` when asked to add special
        tokens, and decodes by concatenating characters.
    """
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    # A BPE model with no merges splits a string into its characters; without a
    # pre-tokenizer, spaces and newlines are ordinary characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=TINY_MODEL_CONFIG["max_position_embeddings"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    warmup_steps: int = 0,
    warmup: WarmupSettings | None = None,
    config_overrides: dict[str, Any] | None = None,
    environments: EnvironmentLookup | None = None,
    kind: TinyModel = TinyModel.DENSE,
) -> Path:
    """Build the tiny model and tokenizer into ``path`` (created if missing).

    The build is deterministic: the same arguments give a byte-identical
    ``model.safetensors`` (the warm-up runs on one thread; across CPUs with
    different kernels its float rounding, hence the bytes, may differ).

    Args:
        path: Output folder.
        seed: Seed of the weight initialisation (and of the warm-up data).
        warmup_steps: Shorthand for ``WarmupSettings(steps=warmup_steps)``.
        warmup: Full warm-up settings; overrides ``warmup_steps``.
        config_overrides: Changes to the architecture's config.
        environments: Source of the warm-up tasks; needed when the warm-up has steps.
        kind: The architecture (dense or MoE).

    Returns:
        The output folder.

    Raises:
        ValueError: The warm-up has steps but no ``environments`` were given.
    """
    from transformers import GenerationConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    warmup = warmup or WarmupSettings(steps=warmup_steps)
    config = tiny_model_config(kind, **(config_overrides or {}))
    tokenizer = build_tokenizer()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (Qwen3MoeForCausalLM if kind is TinyModel.MOE else Qwen3ForCausalLM)(config).to(torch.float32)
    if warmup.steps > 0:
        if environments is None:
            raise ValueError("the tiny model's warm-up needs environments (e.g. env_space.environments.get_environment)")
        _format_warmup(model, tokenizer, seed=seed, settings=warmup, environments=environments)
    model = model.to(torch.bfloat16).eval()

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=16,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    logger.info("built tiny model (seed=%d, warmup=%d steps) in %s", seed, warmup.steps, path)
    return path


def tiny_model_hash(
    *, seed: int = 0, warmup: WarmupSettings | None = None, config_overrides: dict[str, Any] | None = None,
    kind: TinyModel = TinyModel.DENSE,
) -> str:
    """Return a short hash identifying a build (architecture and config, vocabulary, seed, warm-up, build version)."""
    desc = {
        "version": BUILD_VERSION,
        "config": {**kind.base_config, **(config_overrides or {})},
        "vocab": list(vocabulary()),
        "seed": seed,
        "warmup": dataclasses.asdict(warmup or WarmupSettings()),
        "torch": torch.__version__.split("+")[0],
    }
    blob = json.dumps(desc, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_cache_dir() -> Path:
    """Cache root: ``$RLSYNC_CACHE`` if set, else ``~/.cache/rl-sync``."""
    cache = process_settings().cache
    return Path(cache) if cache else Path.home() / ".cache" / "rl-sync"


#: Warm-up used by :func:`tiny_model_path` by default: 75 supervised steps on
#: ``reverse`` and 25 on ``arithmetic``. Measured on 2 CPU cores: the random model
#: scores ~0.004 on ``reverse`` (it rarely emits a digit, almost never EOS); after
#: this warm-up it scores ~0.34 sampled (temperature 1) and ~0.57 greedy, and a
#: plain GRPO loop (16 prompts x 8 samples, lr 1e-3) lifts the sampled reward to
#: ~0.73 in ~100 steps (about 2 minutes). ``arithmetic`` starts at ~0.11 (a number,
#: rarely the right one).
DEFAULT_WARMUP = WarmupSettings(steps=100, environments=("reverse", "reverse", "reverse", "arithmetic"))


def tiny_model_path(
    cache_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    warmup: WarmupSettings | None = DEFAULT_WARMUP,
    config_overrides: dict[str, Any] | None = None,
    environments: EnvironmentLookup | None = None,
    kind: TinyModel = TinyModel.DENSE,
) -> Path:
    """Return the folder of a cached tiny model, building it on first use.

    The folder is ``<cache_dir>/tiny-model-<hash>`` where the hash covers every
    build input, so a changed config never reuses a stale build. Concurrent
    callers are safe: each builds into a private temporary folder that is renamed
    into place atomically.

    Args:
        cache_dir: Cache root; defaults to :func:`default_cache_dir`.
        seed: Initialisation seed.
        warmup: Warm-up settings (``None`` for no warm-up); by default
            :data:`DEFAULT_WARMUP`.
        config_overrides: Changes to the architecture's config.
        environments: Source of the warm-up tasks (see :func:`build_tiny_model`).
        kind: The architecture (dense or MoE).

    Returns:
        The model folder.
    """
    warmup = warmup or WarmupSettings()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"tiny-model-{tiny_model_hash(seed=seed, warmup=warmup, config_overrides=config_overrides, kind=kind)}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        build_tiny_model(tmp, seed=seed, warmup=warmup, config_overrides=config_overrides, environments=environments, kind=kind)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # lost a race to a build that is still incomplete? unlikely
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_complete(path: Path) -> bool:
    names = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
    return all((path / n).is_file() for n in names)


def _format_warmup(
    model, tokenizer, *, seed: int, settings: WarmupSettings, environments: EnvironmentLookup
) -> None:
    """Teach the answer format (digits of the right count, then EOS), not the answers.

    Runs on one thread so the result does not depend on the machine's core count.
    """
    envs = [environments(name) for name in settings.environments]
    rng = random.Random(seed)
    eos = tokenizer.eos_token
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
            model.train()
            for step in range(settings.steps):
                env = envs[step % len(envs)]
                tasks = env.tasks(settings.batch_size, seed=rng.randrange(2**31))
                prompts = [t.prompt for t in tasks]
                targets = [
                    (t.answer if rng.random() < settings.answer_fraction else _scramble_digits(t.answer, rng)) + eos
                    for t in tasks
                ]
                input_ids, attention, labels = _supervised_batch(tokenizer, prompts, targets)
                out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
                opt.step()
                if step % 100 == 0 or step == settings.steps - 1:
                    logger.debug("warm-up step %d loss %.4f", step, out.loss.item())
            model.eval()
    finally:
        torch.set_num_threads(threads)


def _scramble_digits(text: str, rng: random.Random) -> str:
    return "".join(str(rng.randrange(10)) if c.isdigit() else c for c in text)


def _supervised_batch(
    tokenizer, prompts: Sequence[str], targets: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``; loss only on target tokens."""
    rows, label_rows = [], []
    for prompt, target in zip(prompts, targets):
        p = tokenizer(prompt)["input_ids"]
        t = tokenizer(target, add_special_tokens=False)["input_ids"]
        rows.append(p + t)
        label_rows.append([-100] * len(p) + t)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, label_rows)):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention[i, : len(r)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, attention, labels


def is_tiny_model(model: str, device: str) -> bool:
    """Whether the model setting ``model`` trains or serves a tiny offline model on ``device`` (named, or the CPU default)."""
    from .settings import default_model

    return model in {k.value for k in TinyModel} or not (model or default_model(device))


def model_or_default(model: str, device: str, environments: EnvironmentLookup | None = None) -> str:
    """``model`` if set (a :class:`TinyModel` name gives that tiny model's folder), else the device's default
    (:func:`rlsync.spaces.settings.default_model`: Qwen3-0.6B on a GPU), else this tiny offline model's folder
    (built once, deterministically, without any download; its warm-up draws tasks from ``environments``)."""
    from .settings import default_model

    if model in {k.value for k in TinyModel}:
        return str(tiny_model_path(environments=environments, kind=TinyModel(model)))
    return model or default_model(device) or str(tiny_model_path(environments=environments))
