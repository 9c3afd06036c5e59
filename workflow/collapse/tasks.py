"""The paper's seven downstream tasks and their shot counts (docs/method.md §8).

One list for the config's validation and the evaluator, so the two cannot drift apart; each name
has ``eval_tasks/<name>.yaml``.
"""

PAPER_TASK_SHOTS = {
    "arc_challenge": 25,
    "arc_easy": 0,
    "boolq": 0,
    "hellaswag": 10,
    "piqa": 0,
    "siqa": 0,
    "winogrande": 5,
}
PAPER_TASKS = tuple(PAPER_TASK_SHOTS)
