# The model's fields are keyword-only (transformers' configs are dataclasses); the ones the package sets.
class LlamaConfig:
    def __init__(
        self,
        *,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        max_position_embeddings: int = 2048,
        tie_word_embeddings: bool = False,
    ) -> None: ...
