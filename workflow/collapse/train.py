"""Train one run of a family with Megatron-Core, from its RunSpec alone.

One process (CPU, gloo; or one GPU):
    python -m collapse.train --spec results/<family>/plan/runs/<run>.json
Several processes on one node (world size = tp * pp * dp of the spec):
    torchrun --standalone --nproc_per_node=N -m collapse.train --spec SPEC.json
Several nodes (one torchrun per node, e.g. under srun):
    torchrun --nnodes=$NODES --nproc_per_node=$GPUS --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD:29500 -m collapse.train --spec SPEC.json

The job reads the spec and the datasets it names, resumes from the newest complete checkpoint in
``spec.checkpoint_dir`` if there is one, and writes its declared outputs (``curve.parquet``,
``valid.parquet``, ``meta.json`` in ``spec.run_dir``) only when it has finished, atomically,
``meta.json`` last. A job stopped early leaves no outputs that look finished.

A run longer than its cluster's time limit trains in segments (collapse.segments,
docs/time-limits.md): ``--segment K`` trains to segment K's last step of
``spec.resources.segments``, saves, and writes ``runs/<run>/segments/<K>.json`` instead of the
outputs (the last segment writes the outputs). With ``spec.resources.exit_duration_min`` a job
stops, saving, before that much time has passed (``TimeBudget``).

Exit codes: 0 finished (or a segment before the last finished); 75 stopped by SIGTERM/SIGUSR1 or
by the time budget after saving a checkpoint (rerun to resume); 3 the online collapse monitor
raised an alarm (checkpoint saved); 4 the loss became NaN/inf (the last good checkpoint is
kept); 2 bad spec or data; 6 a collective timed out (cluster.distributed_timeout_min: a rank
went silent; the log names it, collapse.hangs).

``run`` trains a step, reads its loss and calls the hooks of its callbacks; evaluation,
checkpoints, the job log, the collapse monitor and its controls audit, TensorBoard, preemption and
an injected fault are callbacks (collapse.callbacks, collapse.tracking, collapse.faults), attached
by ``callbacks_for`` where the spec asks for them.

The batch of step t (1-based) is the global samples [(t-1)*B, t*B) of Megatron's GPTDataset
(shuffled by the spec's seed, as many epochs as needed); data-parallel rank r takes its slice,
cut into micro-batches. Because it depends only on t, a resumed run sees exactly the data of an
uninterrupted one. The LR follows OptimizerParamScheduler(linear warmup, linear decay to 0 over
the *full* ``optim.steps``), stepped after each update as in Megatron (update t uses
``collapse.scaling.lr_at(t-1)``), also when ``optim.stop_fraction`` < 1 ends the run early.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from collapse import checkpoint
from collapse.callbacks import (  # the job's exit codes: its callers import them from here
    EXIT_BAD_INPUT,
    EXIT_MONITOR_ALARM,  # noqa: F401
    EXIT_NONFINITE,  # noqa: F401
    EXIT_OK,
    EXIT_PREEMPTED,  # noqa: F401
    EXIT_SAVE_FAILED,  # noqa: F401
    Callback,
    Checkpointing,
    CollapseMonitor,
    ControlsAudit,
    Evaluation,
    NonFiniteLoss,
    Preemption,
    Progress,
    TimeBudget,
    TrainingError,
    call,
    log,
    make_monitor,
    rank,
)
from collapse.faults import Faults, InjectFault, NonFiniteOutcome, injects, nonfinite_is_outcome
from collapse.layout import CURVE_COLUMNS, VALID_COLUMNS
from collapse.model import params_dtype
from collapse.runspec import RunSpec, spec_hash
from collapse.tracking import tracking_for

CURVE_FILE, VALID_FILE, META_FILE = "curve.parquet", "valid.parquet", "meta.json"


# ------------------------------------------------------------------------------ environment
def trajectory_hash(spec: RunSpec) -> str:
    return hashlib.sha256(spec.trajectory_key().encode()).hexdigest()[:16]


def set_threads(spec: RunSpec) -> int:
    """CPU threads per process: OMP_NUM_THREADS if set, else the job's threads per local rank."""
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    env = os.environ.get("OMP_NUM_THREADS")
    threads = int(env) if env else max(1, spec.resources.threads // max(1, local_procs))
    torch.set_num_threads(threads)
    return threads


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_ROLL_CALL = None  # collapse.hangs.RollCall of a job of several ranks


def init_distributed(spec: RunSpec) -> None:
    """Process group (nccl on GPU, gloo on CPU) and Megatron's model-parallel groups."""
    if "RANK" not in os.environ:  # plain `python -m collapse.train`: a world of one
        # A free port of its own: an inherited MASTER_PORT may belong to another job.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    par = spec.parallel
    world = int(os.environ["WORLD_SIZE"])
    if world != par.tp * par.pp * par.dp:
        raise TrainingError(
            f"world size {world} != parallel.tp*pp*dp = {par.tp}*{par.pp}*{par.dp}: launch with "
            f"torchrun --nproc_per_node={par.tp * par.pp * par.dp} (per node: "
            f"parallel.procs_per_node={par.procs_per_node})",
            EXIT_BAD_INPUT,
        )
    if par.micro_batch_seqs * par.grad_accum * par.dp != spec.optim.batch_seqs:
        raise TrainingError(
            f"parallel.micro_batch_seqs*grad_accum*dp = {par.micro_batch_seqs}*{par.grad_accum}"
            f"*{par.dp} != optim.batch_seqs={spec.optim.batch_seqs}: fix the plan",
            EXIT_BAD_INPUT,
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # a rank that waits longer than this in a collective fails the job instead of hanging it
    # (the cluster's distributed_timeout_min, as Megatron-LM's --distributed-timeout-minutes)
    timeout_min = spec.resources.distributed_timeout_min
    torch.distributed.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_min))
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        distributed_timeout_minutes=timeout_min,
    )
    global _ROLL_CALL
    if world > 1:  # who went silent, should a collective time out (collapse.hangs)
        from collapse.hangs import RollCall

        _ROLL_CALL = RollCall(timeout_min)
    tensor_parallel.model_parallel_cuda_manual_seed(spec.optim.seed)


# ------------------------------------------------------------------------------ data
class _Tokenizer:
    """What GPTDataset asks of a tokenizer (the data stage fixed EOD = 0)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = 0
        self.pad = -1  # never a real id: no sample is padded with a real token
        self.unique_identifiers = {"class": "collapse.train._Tokenizer", "vocab": vocab_size}


def verify_datasets(spec: RunSpec) -> None:
    try:
        from collapse.data import verify_training_data
    except ImportError:  # data stage not installed: fall back to a presence check
        for prefix in (spec.dataset_prefix, spec.valid_prefix):
            for suffix in (".bin", ".idx"):
                if not Path(prefix + suffix).is_file():
                    raise TrainingError(
                        f"{prefix + suffix} is missing: run the data rule first",
                        EXIT_BAD_INPUT,
                    ) from None
        return
    try:
        verify_training_data(spec.dataset_prefix, spec.valid_prefix)
    except Exception as err:  # the data stage's own error names the file and the fix
        raise TrainingError(str(err), EXIT_BAD_INPUT) from err


def build_datasets(spec: RunSpec):
    """GPTDatasets for the full-length schedule (train) and the held-out batches (valid)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from collapse.data import training_blend  # a user's blend, or the two built prefixes

    train_blend, valid_blend = training_blend(spec.dataset_prefix, spec.valid_prefix)
    batch = spec.optim.batch_seqs
    cache = Path(spec.checkpoint_dir) / "dataset_index"
    config = GPTDatasetConfig(
        random_seed=spec.optim.seed,
        sequence_length=spec.model.seq_len,
        blend_per_split=[train_blend, valid_blend, None],
        path_to_cache=str(cache),
        tokenizer=_Tokenizer(spec.model.vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    sizes = [spec.optim.steps * batch, max(1, spec.logging.eval_batches) * batch, None]
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, valid


def train_tokens_in_dataset(dataset) -> int:
    """Tokens in the training split (the denominator of data_fraction, in epochs)."""
    parts = getattr(dataset, "datasets", None) or [dataset]  # a BlendedDataset's parts
    return int(sum(part.dataset.sequence_lengths.sum() for part in parts))


def micro_batches(dataset, first_sample: int, spec: RunSpec) -> list[dict]:
    """This data-parallel rank's micro-batches of the global batch starting at first_sample."""
    from megatron.core import parallel_state

    par = spec.parallel
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = par.micro_batch_seqs * par.grad_accum
    start = first_sample + dp_rank * per_rank
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    out = []
    for m in range(par.grad_accum):
        samples = [
            dataset[start + m * par.micro_batch_seqs + i] for i in range(par.micro_batch_seqs)
        ]
        batch = {
            key: torch.stack([torch.as_tensor(s[key]) for s in samples]).to(device)
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }
        out.append(batch)
    return out


# ------------------------------------------------------------------------------ model & optim
@dataclass
class Stack:
    model: object  # the DDP-wrapped model chunk
    optimizer: object
    scheduler: object
    forward_backward: object
    params_counted: int


def build_stack(spec: RunSpec) -> Stack:
    """The model (µP init, DDP-wrapped), its AdamW with one group per µP group, and the LR
    schedule; parameters counted over the whole model (all pipeline stages)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from collapse.model import build_gpt_model, count_parameters

    on_gpu = torch.cuda.is_available()
    model = build_gpt_model(
        spec,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    counted = torch.tensor([count_parameters(model, spec.model.tied_embeddings)])
    if parallel_state.get_data_parallel_rank() != 0:
        counted.zero_()
    counted = counted.to(torch.cuda.current_device()) if on_gpu else counted
    torch.distributed.all_reduce(counted)
    config = model.config
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    # The distributed optimizer shards Adam state over data-parallel ranks (GPU only: on CPU its
    # 0.16.1 checkpoint load copies in place into a grad-requiring view and fails)
    use_distributed_optimizer = spec.parallel.dp > 1 and on_gpu
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        module=model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = build_optimizer(model, spec, use_distributed_optimizer)
    scheduler = build_scheduler(optimizer, spec)
    return Stack(model, optimizer, scheduler, get_forward_backward_func(), int(counted.item()))


def build_optimizer(model, spec: RunSpec, use_distributed_optimizer: bool):
    """Megatron's AdamW (decoupled weight decay), each µP group with its own LR and λ."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from collapse.model import lr_by_group, wd_mult_by_group
    from megatron_patches.mup import lr_overrides

    on_gpu = torch.cuda.is_available()
    mup, optim = spec.mup, spec.optim
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",  # torch AdamW: decoupled weight decay
            lr=mup.lr_hidden,
            min_lr=0.0,
            weight_decay=optim.weight_decay,
            adam_beta1=mup.adam_beta1,
            adam_beta2=mup.adam_beta2,
            adam_eps=mup.adam_eps,
            clip_grad=optim.grad_clip,
            bf16=params_dtype(on_gpu) == torch.bfloat16,
            params_dtype=params_dtype(on_gpu),
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [model],
        config_overrides=lr_overrides(
            lr_by_group(spec), spec.model.tied_embeddings, wd_mult_by_group(spec)
        ),
    )


def build_scheduler(optimizer, spec: RunSpec):
    """Linear warmup, then linear decay to 0 over the full ``optim.steps``; constant λ."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optim = spec.optim
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=spec.mup.lr_hidden,
        min_lr=0.0,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=optim.steps,
        lr_decay_style="linear",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=optim.steps,
        wd_incr_style="constant",
    )


# ------------------------------------------------------------------------------ steps
LossReduction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The training loss of a micro-batch: the mean per-token loss over its unmasked tokens."""
    mask = loss_mask.float().reshape(-1)
    return (per_token_loss.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)


def _forward_step_factory(reduce_loss: LossReduction):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_mask = batch["loss_mask"]

        def loss_func(per_token_loss: torch.Tensor):
            loss = reduce_loss(per_token_loss, loss_mask)
            # the pipeline schedule divides the returned loss in place: report a clone
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    return forward_step


def _reduce_loss(losses: list[dict], extra: list[float]) -> list[float]:
    """Mean micro-batch loss over data-parallel ranks, plus world sums of ``extra`` flags."""
    from megatron.core import parallel_state

    reporting = parallel_state.is_pipeline_last_stage() and (
        parallel_state.get_tensor_model_parallel_rank() == 0
    )
    local = sum(float(x["lm loss"]) for x in losses) / max(1, len(losses)) if reporting else 0.0
    values = torch.tensor([local, 1.0 if reporting else 0.0, *extra], dtype=torch.float64)
    if torch.cuda.is_available():
        values = values.cuda()
    torch.distributed.all_reduce(values)
    values = values.tolist()
    return [values[0] / max(1.0, values[1]), *values[2:]]


def hidden_weight_decay(stack: Stack, spec: RunSpec) -> float:
    """lambda of the hidden matrices as the optimizer will apply it this step (NaN: no such group).

    Read from the param group, not the spec: the controls audit (collapse.controls) checks the
    timescale the run realized, whatever the plan said."""
    for group in stack.optimizer.param_groups:
        if group.get("wd_mult", 1.0) == 1.0 and math.isclose(
            group.get("max_lr", math.nan), spec.mup.lr_hidden, rel_tol=1e-9
        ):
            return float(group["weight_decay"])
    return math.nan


def train_step(
    stack: Stack,
    batches: list[dict],
    spec: RunSpec,
    reduce_loss: LossReduction = token_mean,
    stop: float = 0.0,
) -> tuple[float, float, bool]:
    """One optimizer update; returns (loss, grad_norm, stop_requested_anywhere).

    ``stop`` (1.0: this rank asks to stop) is summed over the world with the loss."""
    stack.model.zero_grad_buffer()
    stack.optimizer.zero_grad()
    losses = stack.forward_backward(
        forward_step_func=_forward_step_factory(reduce_loss),
        data_iterator=iter(batches),
        model=[stack.model],
        num_microbatches=spec.parallel.grad_accum,
        seq_length=spec.model.seq_len,
        micro_batch_size=spec.parallel.micro_batch_seqs,
        forward_only=False,
    )
    _, grad_norm, _ = stack.optimizer.step()
    stack.scheduler.step(1)
    loss, stop_any = _reduce_loss(losses, [stop])
    return loss, float(grad_norm if grad_norm is not None else float("nan")), stop_any > 0


@torch.no_grad()
def evaluate(stack: Stack, valid, spec: RunSpec) -> float:
    """Mean loss on the first ``logging.eval_batches`` global batches of the held-out split."""
    stack.model.eval()
    total = 0.0
    batches = max(1, spec.logging.eval_batches)
    for b in range(batches):
        micro = micro_batches(valid, b * spec.optim.batch_seqs, spec)
        losses = stack.forward_backward(
            forward_step_func=_forward_step_factory(token_mean),
            data_iterator=iter(micro),
            model=[stack.model],
            num_microbatches=spec.parallel.grad_accum,
            seq_length=spec.model.seq_len,
            micro_batch_size=spec.parallel.micro_batch_seqs,
            forward_only=True,
        )
        total += _reduce_loss(losses, [])[0]
    stack.model.train()
    return total / batches


# ------------------------------------------------------------------------------ state
@dataclass
class RunState:
    """What the outputs are made of; saved with every checkpoint (rank 0's copy counts)."""

    step: int = 0
    curve: list[dict] = field(default_factory=list)
    valid: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    wall_time_s: float = 0.0
    train_time_s: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> RunState:
        return cls(**data)


# The distributed optimizer (dp > 1) saves each rank's buffers as they are: fully parallel, and
# reshardable across data-parallel sizes (0.16.1's default format is not loadable on CPU).
OPTIMIZER_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def sharded_state(stack: Stack, is_loading: bool) -> dict:
    model_state = stack.model.module.sharded_state_dict()
    return {
        "model": model_state,
        "optimizer": stack.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=OPTIMIZER_CHECKPOINT_METADATA
        ),
        "scheduler": stack.scheduler.state_dict(),
    }


def save_checkpoint(stack: Stack, spec: RunSpec, state: RunState) -> Path:
    try:
        path = checkpoint.save(
            spec.checkpoint_dir,
            state.step,
            sharded_state(stack, is_loading=False),
            {"spec_hash": spec_hash(spec), "trajectory": trajectory_hash(spec), **state.to_dict()},
            keep=spec.logging.keep_checkpoints,
        )
    except checkpoint.CheckpointError as err:
        raise TrainingError(str(err), EXIT_SAVE_FAILED) from err
    log(f"checkpoint saved: {path}")
    return path


def prepare_optimizer_state_for_load(stack: Stack) -> None:
    """Give a fresh distributed optimizer the state entries its state_dict() needs.

    Without Apex/TransformerEngine, 0.16.1's DistributedOptimizer.state_dict() reads the Adam
    'step' of every parameter, which a never-stepped torch optimizer lacks; the values are
    replaced by the loaded ones.
    """
    for opt in getattr(stack.optimizer, "chained_optimizers", [stack.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or type(opt).__name__ != "DistributedOptimizer":
            continue
        opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def resume(stack: Stack, spec: RunSpec) -> RunState:
    directory = checkpoint.find_resume_point(spec.checkpoint_dir)
    if directory is None:
        return RunState()
    saved_trajectory = checkpoint.read_train_state(directory).get("trajectory")
    trajectory = trajectory_hash(spec)
    if saved_trajectory not in (None, trajectory):
        # The spec changed what the weights would be (lambda, the seed, the schedule...): the
        # checkpoints are another run's. Resuming would splice two runs into one curve.
        moved = checkpoint.set_aside(spec.checkpoint_dir, saved_trajectory)
        log(
            f"checkpoint {directory} belongs to another trajectory ({saved_trajectory}, this "
            f"spec's is {trajectory}): model, parameterization, optimizer, seed or "
            f"fault changed. Moved to {moved}; training starts afresh"
        )
        return RunState()
    prepare_optimizer_state_for_load(stack)
    loaded, train_state = checkpoint.load(directory, sharded_state(stack, is_loading=True))
    saved_hash = train_state.pop("spec_hash", None)
    train_state.pop("trajectory", None)
    if saved_hash != spec_hash(spec):
        log(
            f"note: checkpoint {directory} was written for another version of the spec "
            f"({saved_hash} != {spec_hash(spec)}) with the same trajectory (layout, logging, "
            "paths or stop may differ); resuming"
        )
    stack.model.module.load_state_dict(loaded["model"])
    stack.optimizer.load_state_dict(loaded["optimizer"])
    stack.scheduler.load_state_dict(loaded["scheduler"])
    state = RunState.from_dict(train_state)
    state.restarts.append({"step": state.step, "time_unix": time.time()})
    log(f"resumed from {directory} at step {state.step}")
    return state


# ------------------------------------------------------------------------------ outputs
def _atomic_write_parquet(rows: list[dict], columns: tuple, path: Path) -> None:
    import pandas as pd

    frame = pd.DataFrame(rows, columns=list(columns))
    tmp = path.with_name(path.name + ".tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(path)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("megatron-core", "collapse"):
        try:
            out[package] = version(package)
        except Exception:
            out[package] = "unknown"
    return out


def write_outputs(
    spec: RunSpec, state: RunState, stack: Stack, steps_target: int, stopped: str = ""
) -> None:
    """curve.parquet, valid.parquet, then meta.json (its presence marks a finished run).

    ``stopped``: why a run ended before its target ("nonfinite": a fault run's NaN loss)."""
    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write_parquet(state.curve, CURVE_COLUMNS, run_dir / CURVE_FILE)
    _atomic_write_parquet(state.valid, VALID_COLUMNS, run_dir / VALID_FILE)
    last = state.curve[-1] if state.curve else {}
    tokens = int(last.get("tokens", 0))
    par = spec.parallel
    meta = {
        "run": spec.run,
        "family": spec.family,
        "size": spec.size,
        "spec_hash": spec_hash(spec),
        "params": spec.params,
        "params_counted": stack.params_counted,
        "tokens": tokens,
        "tokens_planned": spec.optim.tokens,
        "steps_done": state.step,
        "steps_target": steps_target,
        "steps_total": spec.optim.steps,
        "stop_fraction": spec.optim.stop_fraction,
        "final_loss": last.get("loss"),
        "final_valid_loss": state.valid[-1]["valid_loss"] if state.valid else None,
        "wall_time_s": state.wall_time_s,
        "train_time_s": state.train_time_s,
        "tokens_per_s": tokens / state.train_time_s if state.train_time_s > 0 else None,
        "restarts": state.restarts,
        "world_size": torch.distributed.get_world_size(),
        "tp": par.tp,
        "pp": par.pp,
        "dp": par.dp,
        "micro_batch_seqs": par.micro_batch_seqs,
        "grad_accum": par.grad_accum,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dtype": "bf16" if params_dtype(torch.cuda.is_available()) == torch.bfloat16 else "fp32",
        "threads": torch.get_num_threads(),
        "host": socket.gethostname(),
        "fault": spec.fault.model_dump(),
        "stopped": stopped,
        "versions": versions(),
    }
    tmp = run_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    tmp.replace(run_dir / META_FILE)


# ------------------------------------------------------------------------------ the loop
@dataclass
class Loop:
    """A run in progress, as the callbacks see it (collapse.callbacks): its parts, what they
    may ask of it, and the step being trained."""

    spec: RunSpec
    stack: Stack
    state: RunState
    train_set: object
    valid_set: object
    dataset_tokens: int  # tokens in the training split (data_fraction is in its epochs)
    target: int  # the last step this job trains
    started: float  # when this job started (time.time())
    lock: object = None  # the run's lock file, held while the job lives
    exit_code: int | None = None  # set by a hook: the run ends there
    # the step in progress; the hooks of collapse.callbacks say who may change what
    step: int = 0
    step_started: float = 0.0
    data_step: int = 0
    reduce_loss: LossReduction = token_mean
    stop_requested: float = 0.0
    stop_reason: str = ""  # why this rank asked to stop (the log's words)
    stop_anywhere: bool = False
    slowest_save_s: float = 0.0  # the longest checkpoint save of this job
    run_target: int = 0  # the run's last step (a segment's job trains to ``target``)
    segment: int | None = None  # the segment this job trains, of spec.resources.segments
    weight_decay: float = math.nan
    loss: float = math.nan
    lr: float = math.nan
    grad_norm: float = math.nan
    seconds: float = 0.0

    def __post_init__(self):
        self.first_step = self.state.step + 1
        self.wall_before = self.state.wall_time_s
        self.total = self.spec.optim.steps
        self.batch_tokens = self.spec.optim.batch_seqs * self.spec.model.seq_len
        self.run_target = self.run_target or self.target

    def begin(self, step: int) -> None:
        self.step, self.step_started = step, time.time()
        self.data_step, self.reduce_loss = step, token_mean
        self.stop_requested, self.stop_reason = 0.0, ""

    def row(self) -> dict:
        """This step's row of curve.parquet."""
        self.seconds = time.time() - self.step_started
        return {
            "run": self.spec.run,
            "step": self.step,
            "tokens": self.step * self.batch_tokens,
            "t_hat": self.step / self.total,
            "loss": self.loss,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.batch_tokens / self.seconds if self.seconds > 0 else math.nan,
            "micro_batch_seqs": self.spec.parallel.micro_batch_seqs,
            "data_fraction": self.data_step * self.batch_tokens / self.dataset_tokens,
            "restart": self.step == self.first_step and bool(self.state.restarts),
        }

    def record(self) -> None:
        """The step is done: its row goes on the curve."""
        self.state.curve.append(self.row())
        self.state.step = self.step
        self.state.train_time_s += self.seconds

    def update_wall_time(self) -> None:
        self.state.wall_time_s = self.wall_before + time.time() - self.started

    def evaluate(self) -> float:
        return evaluate(self.stack, self.valid_set, self.spec)

    def save_checkpoint(self) -> Path:
        self.update_wall_time()
        began = time.time()
        path = save_checkpoint(self.stack, self.spec, self.state)
        self.slowest_save_s = max(self.slowest_save_s, time.time() - began)
        return path

    def checkpoint_exists(self) -> bool:
        return checkpoint_exists_for(self.spec, self.state.step)

    def write_outputs(self, stopped: str = "") -> None:
        if rank() == 0:
            write_outputs(self.spec, self.state, self.stack, self.target, stopped)


def start(spec: RunSpec, started: float, segment: int | None = None) -> Loop:
    """Everything before the first step: threads, patches, data, the lock on the run, the world,
    the model and optimizer, and the resume from the newest complete checkpoint. ``segment``:
    the job trains only that segment of the run (collapse.segments)."""
    import megatron_patches

    threads = set_threads(spec)
    patches = megatron_patches.apply()
    verify_datasets(spec)
    lock = None
    if int(os.environ.get("RANK", "0")) == 0:  # one training per run (the job's rank 0 holds it)
        try:
            lock = checkpoint.lock_run(spec.checkpoint_dir)
        except checkpoint.CheckpointError as err:
            raise TrainingError(str(err), EXIT_BAD_INPUT) from None
    init_distributed(spec)
    par = spec.parallel
    log(
        f"run {spec.run}: params {spec.params:,} tokens {spec.optim.tokens:,} steps "
        f"{spec.optim.steps} batch {spec.optim.batch_seqs}x{spec.model.seq_len} "
        f"(micro {par.micro_batch_seqs} x accum {par.grad_accum} x dp {par.dp}) tp {par.tp} "
        f"pp {par.pp}; threads {threads}; patches {', '.join(patches)}"
    )
    train_set, valid_set = build_datasets(spec)
    stack = build_stack(spec)
    state = resume(stack, spec)
    run_target = steps_target(spec)
    return Loop(
        spec,
        stack,
        state,
        train_set,
        valid_set,
        train_tokens_in_dataset(train_set),
        segment_target(spec, segment, run_target),
        started,
        lock,
        run_target=run_target,
        segment=segment,
    )


def segment_target(spec: RunSpec, segment: int | None, run_target: int) -> int:
    """The last step this job trains: the run's, or its segment's (collapse.segments)."""
    if segment is None:
        return run_target
    from collapse.segments import segment_end

    segments = spec.resources.segments
    if not 1 <= segment <= segments:
        raise TrainingError(
            f"--segment {segment}: the spec plans resources.segments={segments}; pass 1.."
            f"{segments}",
            EXIT_BAD_INPUT,
        )
    return segment_end(run_target, segments, segment)


def time_budget(spec: RunSpec) -> list[Callback]:
    """The stop by time, where the plan gives the job an exit duration (a cluster time limit)."""
    r = spec.resources
    if r.exit_duration_min <= 0:
        return []
    return [TimeBudget(r.exit_duration_min * 60, r.checkpoint_save_min * 60)]


def callbacks_for(spec: RunSpec, preemption: Preemption) -> list[Callback]:
    """The run's callbacks, in the order their hooks are called: what its spec asks for."""
    monitor = make_monitor(spec)  # rank 0's, when the spec enables it
    callbacks: list[Callback] = []
    if injects(spec):
        callbacks.append(InjectFault(Faults.of(spec)))
    if monitor is not None:
        callbacks.append(ControlsAudit(monitor))
    callbacks.append(NonFiniteOutcome() if nonfinite_is_outcome(spec) else NonFiniteLoss())
    # trackers before the log line: once the log shows step N, the dashboards hold it too
    callbacks += [Evaluation(), *tracking_for(spec, monitor), Progress()]
    if spec.monitor.enabled:
        callbacks.append(CollapseMonitor(monitor))
    return [*callbacks, *time_budget(spec), preemption, Checkpointing()]


def run(spec: RunSpec, segment: int | None = None) -> int:
    """Train (or resume) one run, or one segment of it; return the exit code."""
    started = time.time()
    preemption = Preemption()  # first: a signal during the setup stops the run after a step
    loop = start(spec, started, segment)
    callbacks = callbacks_for(spec, preemption)
    call(callbacks, "on_train_start", loop)
    for step in range(loop.first_step, loop.target + 1):
        loop.begin(step)
        call(callbacks, "on_step_start", loop)
        loop.weight_decay = hidden_weight_decay(loop.stack, spec)
        batches = micro_batches(loop.train_set, (loop.data_step - 1) * spec.optim.batch_seqs, spec)
        loop.loss, loop.grad_norm, loop.stop_anywhere = train_step(
            loop.stack, batches, spec, loop.reduce_loss, loop.stop_requested
        )
        loop.lr = scheduler_lr_at(loop.stack.scheduler, step - 1, spec.mup.lr_hidden)
        call(callbacks, "on_loss", loop)
        if loop.exit_code is None:
            loop.record()
            call(callbacks, "on_step_end", loop)
        if loop.exit_code is not None:
            return loop.exit_code
    loop.update_wall_time()
    call(callbacks, "on_train_end", loop)
    if loop.target < loop.run_target:  # a segment before the last: its checkpoint, its marker
        finish_segment(loop)
        return EXIT_OK
    loop.write_outputs()
    log(
        f"done: {loop.state.step} steps, final loss {loop.state.curve[-1]['loss']:.4f}, "
        f"{loop.state.train_time_s:.1f} s training"
    )
    return EXIT_OK


def finish_segment(loop: Loop) -> None:
    """A segment's end: its checkpoint is saved (Checkpointing.on_train_end); the marker the
    next segment's job waits for says so."""
    from collapse.segments import write_marker

    if rank() == 0:
        path = write_marker(
            loop.spec.run_dir,
            loop.segment,
            loop.spec.resources.segments,
            {
                "run": loop.spec.run,
                "step": loop.state.step,
                "steps_target": loop.run_target,
                "wall_time_s": loop.state.wall_time_s,
                "spec_hash": spec_hash(loop.spec),
            },
        )
        log(
            f"segment {loop.segment} of {loop.spec.resources.segments} done at step "
            f"{loop.state.step} of {loop.run_target}: {path}"
        )


def steps_target(spec: RunSpec) -> int:
    """Steps this job trains: the whole schedule, or its stop_fraction (sweeps)."""
    fraction = spec.optim.stop_fraction
    if not 0 < fraction <= 1:
        raise TrainingError(f"optim.stop_fraction={fraction} must be in (0, 1]", EXIT_BAD_INPUT)
    return max(1, min(spec.optim.steps, math.ceil(fraction * spec.optim.steps - 1e-9)))


def scheduler_lr_at(scheduler, num_steps: int, max_lr: float) -> float:
    """The LR the scheduler gives a group of peak ``max_lr`` after ``num_steps`` steps."""
    saved = scheduler.num_steps
    scheduler.num_steps = num_steps
    try:
        return scheduler.get_lr({"max_lr": max_lr, "min_lr": 0.0})
    finally:
        scheduler.num_steps = saved


def checkpoint_exists_for(spec: RunSpec, step: int) -> bool:
    """True when a complete checkpoint of ``step`` exists (agreed across ranks)."""
    found = checkpoint.find_resume_point(spec.checkpoint_dir)
    return found is not None and checkpoint.step_of(found) == step


def main(argv: list[str] | None = None) -> int:
    # Megatron-Core warns once per module that TransformerEngine/Apex are absent (expected here)
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    parser = argparse.ArgumentParser(prog="python -m collapse.train", description=__doc__)
    parser.add_argument("--spec", required=True, help="the run's RunSpec JSON")
    parser.add_argument(
        "--segment",
        type=int,
        default=None,
        help="train only this segment (1-based) of a run planned in resources.segments jobs: "
        "resume, train to its last step, save, and write runs/<run>/segments/<k>.json",
    )
    args = parser.parse_args(argv)
    try:
        spec = RunSpec.load(args.spec)
    except Exception as err:
        print(f"error: cannot read the run spec {args.spec}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        code = run(spec, args.segment)
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        code = err.exit_code
    except Exception as err:
        from collapse.hangs import EXIT_COLLECTIVE_TIMEOUT, is_collective_timeout

        if _ROLL_CALL is None or not is_collective_timeout(err):
            raise
        print(f"error: {_ROLL_CALL.report(err)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # the process group is broken: leaving through Python's exit would abort in gloo
        os._exit(EXIT_COLLECTIVE_TIMEOUT)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":  # dist_checkpointing starts a spawn manager that re-imports __main__
    sys.exit(main())
