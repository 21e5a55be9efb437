"""Qwen3's dimensions and tensor shapes for the benchmarks, torch only (no ``transformers`` import).

``MODELS`` holds named models' ``Qwen3Config`` arguments, :func:`model_config` a named model's or a
smaller Qwen3's, and :func:`qwen3_shapes` the checkpoint tensors such a config makes, with the tied
head listed once (as a publisher ships it).
"""

from __future__ import annotations

def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> dict:
    """A Qwen3 release's ``Qwen3Config`` arguments (every size has 8 KV heads of 128 and the same vocabulary)."""
    return dict(
        vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, tie_word_embeddings=tied,
    )  # fmt: skip


MODELS = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
}


def model_config(model: str | None, params: float | None) -> dict:
    """Qwen3Config arguments: a named model's, or a smaller Qwen3 of about ``params`` parameters."""
    if model:
        return dict(MODELS[model])
    hidden = 1024 if params >= 300e6 else 512 if params >= 40e6 else 256
    vocab = 32768
    per_layer = 4 * hidden * hidden + 3 * hidden * 3 * hidden  # q, k, v, o (kv = q / 2 + ...) and the MLP, roughly
    layers = max(1, round((params - vocab * hidden) / per_layer))
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip


def qwen3_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of a Qwen3 with ``config`` (``Qwen3Config`` arguments) by their transformers names; a
    tied head (``tie_word_embeddings``) is the embedding, so listed once."""
    keys = ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    h, hd, heads, kv, inter = (config[k] for k in keys)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })  # fmt: skip
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes
