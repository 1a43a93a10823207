"""Reference models: dense decoders (:mod:`autoshard.models.dense`: an MLP, GPT-2, LLaMA),
mixture-of-experts decoders (:mod:`autoshard.models.moe`) and their presets by name
(:mod:`autoshard.models.catalog`). They import nothing of the planner or the runtime."""

from autoshard.models.dense import (
    GPT2_PRESETS,
    LLAMA_PRESETS,
    MLP,
    Attention,
    FeedForward,
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaConfig,
    RMSNorm,
    SwiGLU,
    Transformer,
    TransformerBlock,
    TransformerConfig,
    gpt2,
    init_decoder,
    llama,
    rope_buffers,
)

__all__ = [
    "GPT2_PRESETS", "LLAMA_PRESETS", "MLP", "Attention", "FeedForward", "Llama", "LlamaAttention", "LlamaBlock",
    "LlamaConfig", "RMSNorm", "SwiGLU", "Transformer", "TransformerBlock", "TransformerConfig", "gpt2",
    "init_decoder", "llama", "rope_buffers",
]
