"""Sync benchmark on a language model trained on real text, fine-tuned with AdamW at RL learning rates.

No package in the registry lists ships the weights of a pretrained transformer LM
inside it (the lists were searched; the candidates download at run time), and
nothing here may download. So this benchmark trains its own: a Qwen3-architecture
byte-level LM (6.7M parameters by default), pretrained from a seeded init on real
text, the Python standard library's sources, with AdamW at lr 1e-3 (30 steps of
4 x 128 bytes by default: its weights move well away from the init distribution
and its loss falls by half; a substitute for a pretrained checkpoint, not one). Then,
for each RL learning rate, AdamW (fp32 master weights) fine-tunes it on other
text with the LM loss (real gradients), and the bf16 snapshots before and after
the last step are measured exactly as :mod:`benchmarks.sync` measures its
synthetic states: the same table for every codec, plus the entropy bounds of the
delta (context-free and given the old exponent).

    python -m benchmarks.trained_lm                       # ~2 min on 2 quiet CPU cores, ~6 under load
    python -m benchmarks.trained_lm --hidden 256 --layers 4 --pretrain-steps 40
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch

from benchmarks.entropy import delta_entropy
from benchmarks.sync import measure, print_table


def corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the Python standard library's sources (sorted files), as a uint8 tensor: real, offline text."""
    data = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


def byte_lm(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    """A seeded Qwen3-architecture causal LM over bytes (256-token vocabulary)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).float()


class Batches:
    """Seeded random windows of a token stream."""

    def __init__(self, tokens: torch.Tensor, batch: int, length: int, seed: int) -> None:
        self.tokens, self.batch, self.length = tokens, batch, length
        self.gen = torch.Generator().manual_seed(seed)

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(0, self.tokens.numel() - self.length, (self.batch,), generator=self.gen)
        return torch.stack([self.tokens[s : s + self.length] for s in starts.tolist()])


def train(model: torch.nn.Module, batches: Batches, lr: float, steps: int) -> list[float]:
    """AdamW steps (weight decay 0) with the LM loss; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        ids = next(batches)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 weights a trainer would publish."""
    return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}


def finetune(model: torch.nn.Module, batches: Batches, lr: float, steps: int) -> tuple[dict, dict]:
    """Fine-tune with AdamW at ``lr``; return the bf16 snapshots before and after the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    before = snapshot(model)
    for _ in range(steps):
        before = snapshot(model)
        ids = next(batches)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return before, snapshot(model)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pretrain-steps", type=int, default=30)
    ap.add_argument("--pretrain-lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6])
    ap.add_argument("--finetune-steps", type=int, default=6, help="AdamW steps per learning rate; the last one is measured")
    ap.add_argument("--codecs", nargs="+", default=["trl", "gapzz", "classgap", "classrice"])
    ap.add_argument("--repeat", type=int, default=3, help="interleaved timing rounds (best of)")
    args = ap.parse_args(argv)

    text = corpus(4 << 20)
    split = text.numel() * 3 // 4
    model = byte_lm(args.hidden, args.layers, seed=0)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3 architecture, {n / 1e6:.1f}M parameters, byte vocabulary; {text.numel() / 1e6:.1f} MB of stdlib sources")
    t0 = time.perf_counter()
    losses = train(model, Batches(text[:split], args.batch, args.length, seed=1), args.pretrain_lr, args.pretrain_steps)
    tokens = args.pretrain_steps * args.batch * args.length
    seconds = time.perf_counter() - t0
    print(f"pretrained {args.pretrain_steps} steps ({tokens / 1e3:.0f}k tokens) in {seconds:.0f} s: loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    for lr in args.lrs:
        model.load_state_dict(pretrained)
        old, new = finetune(model, Batches(text[split:], args.batch, args.length, seed=2), lr, args.finetune_steps)
        print_table(lr, measure(old, new, args.codecs, args.repeat), delta_entropy(old, new))


if __name__ == "__main__":
    main()
