"""Small models shared by the check scripts and the benchmarks."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["LLAMA_7B", "TinyEncoder", "TwoHalves", "llama_decoder"]

#: The Llama-2-7B shape (random weights; nothing is downloaded).
LLAMA_7B: dict[str, int] = {"layers": 32, "hidden": 4096, "intermediate": 11008, "heads": 32, "vocab": 32000}


class TwoHalves(nn.Module):
    """``second(tanh(first(x)))``: two square ``Linear`` layers of about ``size_mib`` MiB each.

    With ``layers > 1`` each half is a stack of that many square ``Linear``
    layers (``tanh`` between them) of about ``size_mib`` MiB together, so that
    DDP's gradient buckets can overlap the backward pass.

    Example:
        >>> net = TwoHalves(0.01, names=("a", "b"))
        >>> net.a.in_features == net.b.out_features, net(torch.zeros(1, net.a.in_features)).shape[0]
        (True, 1)
    """

    def __init__(self, size_mib: float, names: Sequence[str] = ("layer1", "layer2"), layers: int = 1) -> None:
        super().__init__()
        width = int((size_mib / layers * 2**20 / 4) ** 0.5)
        self.names = tuple(names)
        for name in self.names:
            if layers == 1:
                self.add_module(name, nn.Linear(width, width))
            else:
                stack: list[nn.Module] = []
                for i in range(layers):
                    stack += [nn.Linear(width, width)] + ([nn.Tanh()] if i < layers - 1 else [])
                self.add_module(name, nn.Sequential(*stack))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (getattr(self, name) for name in self.names)
        return second(torch.tanh(first(x)))


def llama_decoder(
    layers: int = 2,
    hidden: int = 64,
    intermediate: int = 172,
    heads: int = 4,
    vocab: int = 256,
    *,
    max_positions: int = 4096,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """A Llama-style causal decoder from a transformers ``LlamaConfig`` (random weights).

    ``device="meta"`` builds it without memory (for the planner); ``**LLAMA_7B``
    gives the Llama-2-7B shape. Group it one layer per group with
    ``ParamGroups.from_layers(model, "model.layers", extra={"emb": "model.embed_tokens.*",
    "head": ["model.norm.*", "lm_head.*"]})``.

    Example:
        >>> net = llama_decoder(**LLAMA_7B, device="meta")
        >>> round(sum(p.numel() for p in net.parameters()) / 1e9, 2)
        6.74
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype` directly: no transient fp32 copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model


class _Embeddings(nn.Module):
    def __init__(self, vocab: int, width: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.tok(input_ids)))


class _Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        out = self.norm(hidden_states + self.drop(self.ff(hidden_states)))
        return (out if mask is None else out * mask, None)  # a tuple, as Hugging Face blocks return


class TinyEncoder(nn.Module):
    """A token encoder shaped like a Hugging Face one: ``embeddings``, blocks in ``layers``, a ``head``.

    ``forward(input_ids, labels=None)`` returns the logits, or the cross-entropy
    loss of the mean-pooled sequence when ``labels`` is given. Dropout everywhere.

    Example:
        >>> net = TinyEncoder(layers=2)
        >>> net(torch.zeros(3, 5, dtype=torch.long)).shape
        torch.Size([3, 4])
    """

    def __init__(
        self, layers: int = 4, width: int = 16, vocab: int = 50, classes: int = 4, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vocab, width, dropout)
        self.layers = nn.ModuleList(_Block(width, dropout) for _ in range(layers))
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(width, classes))

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.tok

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for block in self.layers:
            hidden = block(hidden)[0]
        logits = self.head(hidden.mean(dim=1))
        return logits if labels is None else nn.functional.cross_entropy(logits, labels)
