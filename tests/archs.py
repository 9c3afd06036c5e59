"""A small architecture for the scaling, FLOPs and layout tests (hand arithmetic stays short)."""

from collapse.runspec import ModelArch


def small_arch(**overrides) -> ModelArch:
    fields = dict(
        d_model=64,
        n_layers=2,
        n_heads=4,
        head_dim=16,
        ffn_hidden=256,
        activation="gelu",
        positions="learned",
        vocab_size=100,
        seq_len=32,
        tied_embeddings=True,
    )
    fields.update(overrides)
    return ModelArch(**fields)
