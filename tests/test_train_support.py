"""Helpers for the training tests: tiny RunSpecs, tiny indexed datasets, running the job.

No tests here; test_train*.py, test_checkpoint*.py and test_patches.py import these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from workflow_cli import REPO

from collapse.runspec import (
    Logging,
    ModelArch,
    Optimization,
    Parallelism,
    Parameterization,
    Resources,
    RunSpec,
)

VOCAB = 256


def write_indexed_dataset(prefix: Path, n_docs: int, seed: int, vocab: int = VOCAB) -> None:
    """Documents of a learnable toy language (repeating runs of tokens), EOD 0 at each end."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(n_docs):
        start = int(rng.integers(1, vocab - 8))
        period = int(rng.integers(2, 6))
        length = int(rng.integers(30, 200))
        doc = [1 + (start + (i % period) * 3) % (vocab - 1) for i in range(length)] + [0]
        builder.add_item(torch.tensor(doc, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def _split_summary(prefix: Path) -> dict:
    """The fields of the data stage's meta.json that collapse.data.verify_dataset checks."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return {
        "prefix": prefix.name,
        "documents": len(dataset.document_indices) - 1,
        "tokens": int(dataset.sequence_lengths.sum()),
        "bin_bytes": Path(f"{prefix}.bin").stat().st_size,
        "idx_bytes": Path(f"{prefix}.idx").stat().st_size,
    }


def make_datasets(root: Path) -> tuple[str, str]:
    """Train and held-out toy datasets under root/data, with a meta.json like the data stage's."""
    train, valid = root / "data" / "train_text_document", root / "data" / "valid_text_document"
    if not Path(f"{train}.idx").exists():
        write_indexed_dataset(train, n_docs=400, seed=1)
        write_indexed_dataset(valid, n_docs=60, seed=2)
        meta = {"train": _split_summary(train), "valid": _split_summary(valid)}
        (root / "data" / "meta.json").write_text(json.dumps(meta))
    return str(train), str(valid)


def tiny_spec(
    root: Path,
    *,
    run: str = "tiny",
    steps: int = 12,
    d_model: int = 32,
    n_layers: int = 2,
    n_heads: int = 4,
    seq_len: int = 32,
    batch_seqs: int = 8,
    micro_batch_seqs: int = 4,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    activation: str = "gelu",
    positions: str = "rope",
    tied: bool = False,
    kind: str = "mup",
    checkpoint_every: int = 0,
    eval_every: int = 0,
    stop_fraction: float = 1.0,
    **overrides,
) -> RunSpec:
    """A complete RunSpec of a tiny model (µP numbers of docs/method.md §7, base width 32)."""
    train, valid = make_datasets(root)
    head_dim = d_model // n_heads
    d_base, width_mult = 32, d_model / 32
    sigma, eta = 0.0867, 1e-2
    mup_on = kind != "sp"
    mup = Parameterization(
        kind=kind,
        d_base=d_base,
        depth_base=2,
        width_mult=width_mult,
        depth_mult=n_layers / 2,
        alpha_input=9.17 if mup_on else 1.0,
        logit_multiplier=1.095 / width_mult if mup_on else 1.0,
        residual_multiplier=(2 / n_layers) if kind == "completep" else 1.0,
        attention_scale=(1.0 / head_dim) if mup_on else head_dim**-0.5,
        init_std_embedding=sigma,
        init_std_hidden=sigma / width_mult**0.5,
        init_std_output_proj=sigma
        / (2 * width_mult * (2 if kind == "completep" else n_layers)) ** 0.5,
        init_std_unembedding=sigma / width_mult**0.5,
        lr_embedding=eta,
        lr_hidden=eta / width_mult,
        lr_output_proj=eta / width_mult,
        lr_unembedding=eta / width_mult,
        lr_norm_bias=eta,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
    )
    grad_accum = batch_seqs // (micro_batch_seqs * dp)
    fields = dict(
        run=run,
        family="test",
        size="tiny",
        tpp_band=20.0,
        tpp=20.0,
        params=100_000,
        params_non_embedding=50_000,
        flops_6nd=1.0,
        flops=1.0,
        dataset_prefix=train,
        valid_prefix=valid,
        tokenizer=str(root / "data" / "tokenizer.json"),
        run_dir=str(root / "runs" / run),
        checkpoint_dir=str(root / "checkpoints" / run),
        model=ModelArch(
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            head_dim=head_dim,
            ffn_hidden=4 * d_model,
            activation=activation,
            positions=positions,
            vocab_size=VOCAB,
            seq_len=seq_len,
            tied_embeddings=tied,
        ),
        mup=mup,
        optim=Optimization(
            seed=1234,
            tokens=steps * batch_seqs * seq_len,
            batch_seqs=batch_seqs,
            steps=steps,
            warmup_steps=max(1, steps // 10),
            lr_peak=mup.lr_hidden,
            weight_decay=0.1,
            tau=0.2,
            stop_fraction=stop_fraction,
        ),
        parallel=Parallelism(
            tp=tp,
            pp=pp,
            dp=dp,
            micro_batch_seqs=micro_batch_seqs,
            grad_accum=grad_accum,
            gpus=0,
            nodes=1,
            procs_per_node=tp * pp * dp,
        ),
        resources=Resources(threads=1, mem_mb=2000, gpus_per_node=0, nodes=1, runtime_min=10),
        logging=Logging(
            log_every_steps=1,
            eval_every_steps=eval_every,
            eval_batches=1,
            checkpoint_every_steps=checkpoint_every,
            keep_checkpoints=2,
        ),
    )
    fields.update(overrides)
    return RunSpec(**fields)


def write_spec(spec: RunSpec, root: Path) -> Path:
    path = root / "plan" / f"{spec.run}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.to_json())
    return path


def job_env(threads: int = 1) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    return env


def train_command(spec_path: Path, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "collapse.train", "--spec", str(spec_path)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "collapse.train",
        "--spec",
        str(spec_path),
    ]


def run_training(spec: RunSpec, root: Path, nproc: int = 1, timeout: int = 300):
    """Run the real entry point in a subprocess; return the CompletedProcess."""
    path = write_spec(spec, root)
    return subprocess.run(
        train_command(path, nproc),
        env=job_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(spec: RunSpec) -> list[float]:
    import pandas as pd

    return pd.read_parquet(Path(spec.run_dir) / "curve.parquet")["loss"].tolist()
