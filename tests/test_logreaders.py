"""Curves read from other stacks' logs: TensorBoard event files written by torch's
SummaryWriter and W&B runs written by wandb in offline mode (no network), checked against
the same curves read from the CSV path."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from logwriters import write_events, write_wandb_runs
from synthetic import synthetic_family

from collapse import curves as C
from collapse import logreaders as L
from collapse.cli import main
from collapse.validate import InputError

SIZES = {"s1": 3.4, "s2": 3.1, "s4": 2.8}
STEPS = 300
META = ["size", "seed", "tpp", "tau", "steps"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A synthetic family as a CSV, as TensorBoard runs (Megatron-LM's tag) and a sidecar."""
    root = tmp_path_factory.mktemp("logs")
    df = synthetic_family(SIZES, seeds=2, steps=STEPS, noise_rel=0.005, rng_seed=1)
    df.to_csv(root / "curves.csv", index=False)
    meta = df.groupby("run", sort=False)[META].first().reset_index()
    sidecar = root / "runs.yaml"
    sidecar.write_text(
        "\n".join(
            f"{r.run}: {{size: {r.size}, seed: {r.seed}, tpp: {r.tpp}, tau: {r.tau}, "
            f"steps: {r.steps}}}"
            for r in meta.itertuples()
        )
        + "\n"
    )
    for run, rows in df.groupby("run", sort=False):
        write_events(root / "tb" / run, "lm loss", rows["step"], rows["loss"], {"lr": 1e-4})
    return df, root


def _same_curves(from_logs: C.Curves, from_csv: C.Curves) -> None:
    assert sorted(from_logs.runs) == sorted(from_csv.runs)
    a = from_logs.data.astype({"run": str}).sort_values(["run", "step"]).reset_index(drop=True)
    b = from_csv.data.astype({"run": str}).sort_values(["run", "step"]).reset_index(drop=True)
    assert (a["run"].astype(str) == b["run"].astype(str)).all()
    np.testing.assert_array_equal(a["step"], b["step"])
    # event files hold float32: the CSV's loss rounded to float32 is what comes back
    np.testing.assert_array_equal(a["loss"], b["loss"].astype(np.float32).astype(float))
    np.testing.assert_allclose(a["t_hat"], b["t_hat"])
    for column in META:
        left = from_logs.meta[column].sort_index().astype(str)
        assert (left == from_csv.meta[column].sort_index().astype(str)).all(), column


def test_tensorboard_dir_reads_like_the_csv(family):
    df, root = family
    assert L.is_log_source(root / "tb") and not L.is_log_source(root / "curves.csv")
    _same_curves(C.read_curves(root / "tb", root / "runs.yaml"), C.read_curves(root / "curves.csv"))


def test_analyze_on_tensorboard_matches_the_csv(family, tmp_path, capsys):
    _, root = family
    assert main(["analyze", str(root / "tb"), "--runs", str(root / "runs.yaml"),
                 "--out", str(tmp_path / "tb")]) == 0  # fmt: skip
    assert main(["analyze", str(root / "curves.csv"), "--out", str(tmp_path / "csv")]) == 0
    tb = json.loads((tmp_path / "tb" / "collapse.json").read_text())
    csv = json.loads((tmp_path / "csv" / "collapse.json").read_text())
    assert tb["reference_sizes"] == csv["reference_sizes"] == ["s1", "s2"]
    assert tb["score"] == pytest.approx(csv["score"], rel=1e-4)
    assert {r: v["status"] for r, v in tb["gates"].items()} == {
        r: v["status"] for r, v in csv["gates"].items()
    }


def test_predict_reads_tensorboard(family, tmp_path):
    _, root = family
    args = ["--reference-sizes", "s1,s2", "--fraction", "0.5", "--out", str(tmp_path)]
    rc = main(["predict", str(root / "tb"), "--runs", str(root / "runs.yaml"), *args])
    assert rc == 0
    table = pd.read_csv(tmp_path / "predictions.csv")
    assert set(table["run"]) == {"s4_s0", "s4_s1"}


@pytest.mark.parametrize(
    "tag",
    [
        "loss_metrics/global_avg_loss",
        "train/CE loss",
        "reduced_train_loss",
        "train/loss",
        "lm loss",
    ],
)
def test_each_known_tag_is_found(tmp_path, tag):
    write_events(tmp_path / "run", tag, range(1, 21), np.linspace(4, 3, 20), {"grad_norm": 1})
    curves = C.read_curves(tmp_path)
    assert curves.runs == [tmp_path.name] or curves.runs == ["run"]
    np.testing.assert_allclose(curves.data["loss"], np.linspace(4, 3, 20), rtol=1e-6)


def test_missing_loss_tag_lists_the_tags_present(tmp_path):
    write_events(tmp_path / "a", "my/objective", range(1, 11), np.linspace(4, 3, 10), {"lr": 1})
    with pytest.raises(InputError, match="no run logs the loss tag") as err:
        C.read_curves(tmp_path)
    assert "'lr'" in str(err.value) and "'my/objective'" in str(err.value)
    assert "--loss-tag" in str(err.value)
    assert len(C.read_curves(tmp_path, loss_tag="my/objective").data) == 10
    with pytest.raises(InputError, match="no run logs the loss tag 'nope'"):
        C.read_curves(tmp_path, loss_tag="nope")


def test_cli_error_names_the_tags(tmp_path, capsys):
    write_events(tmp_path / "tb" / "a", "objective", range(1, 11), np.linspace(4, 3, 10))
    assert main(["analyze", str(tmp_path / "tb"), "--out", str(tmp_path / "o")]) == 2
    assert "scalar tags present: 'objective'" in capsys.readouterr().err


def test_resumed_job_is_stitched(tmp_path):
    """A job resumed from the checkpoint at step 200 logs 201.. again into a second file."""
    run = tmp_path / "run"
    write_events(run, "lm loss", range(1, 301), np.full(300, 4.0))
    write_events(run, "lm loss", range(201, 401), np.full(200, 3.0))
    with pytest.warns(L.LogStitchWarning, match="resumed from a checkpoint, first at step 201"):
        curves = C.read_curves(tmp_path)
    data = curves.data
    np.testing.assert_array_equal(data["step"], np.arange(1, 401))
    assert (data["loss"][data["step"] <= 200] == 4.0).all()
    assert (data["loss"][data["step"] > 200] == 3.0).all()


def test_a_runs_folders_joined_by_the_sidecars_log_column(tmp_path):
    """torchtitan starts a folder per job (tb/<date-time>): the sidecar says whose they are."""
    write_events(
        tmp_path / "20260101-1200", "loss_metrics/global_avg_loss", range(1, 151), [4.0] * 150
    )
    write_events(
        tmp_path / "20260101-1400", "loss_metrics/global_avg_loss", range(101, 301), [3.0] * 200
    )
    sidecar = tmp_path.parent / f"{tmp_path.name}-runs.csv"
    sidecar.write_text("run,log,size,steps\nd64,20260101-1200,d64,300\nd64,20260101-1400,d64,300\n")
    with pytest.warns(L.LogStitchWarning, match="first at step 101"):
        curves = C.read_curves(tmp_path, sidecar)
    assert curves.runs == ["d64"] and curves.meta.loc["d64", "size"] == "d64"
    np.testing.assert_array_equal(curves.data["step"], np.arange(1, 301))
    assert (curves.data["loss"][curves.data["step"] > 100] == 3.0).all()


def test_counter_back_to_the_start_is_refused(tmp_path):
    run = tmp_path / "run"
    write_events(run, "lm loss", range(1, 101), np.full(100, 4.0))
    write_events(run, "lm loss", range(1, 51), np.full(50, 3.0))
    with pytest.raises(InputError, match="goes back from 100 to 1.*two attempts in one folder"):
        C.read_curves(tmp_path)


def test_two_runs_with_the_same_name(tmp_path):
    for parent in ("a", "b"):
        write_events(tmp_path / parent / "d64", "lm loss", range(1, 11), np.linspace(4, 3, 10))
    with pytest.raises(InputError, match="two runs are named 'd64'") as err:
        C.read_curves([tmp_path / "a", tmp_path / "b"])
    assert str(tmp_path / "a" / "d64") in str(err.value)
    assert str(tmp_path / "b" / "d64") in str(err.value)


def test_half_written_event_file_reads_its_complete_records(tmp_path):
    """A file cut inside its last record (a writer mid-flush) yields every complete record."""
    write_events(tmp_path / "full", "lm loss", range(1, 51), np.linspace(4, 3, 50))
    source = next((tmp_path / "full").glob("*tfevents*"))
    cut = tmp_path / "cut" / "run"
    cut.mkdir(parents=True)
    data = source.read_bytes()
    (cut / source.name).write_bytes(data[:-7])
    curves = C.read_curves(tmp_path / "cut")
    np.testing.assert_array_equal(curves.data["step"], np.arange(1, 50))
    tb = L.TensorBoardDir(tmp_path / "cut")
    tb.poll()
    assert len(tb.runs["run"].scalars["lm loss"]) == 49
    with (cut / source.name).open("ab") as handle:  # the writer finishes its record
        handle.write(data[-7:])
    assert tb.poll() == {"run"}
    assert tb.runs["run"].scalars["lm loss"][-1][0] == 50


def test_corrupt_record_header_stops_the_read_with_a_note(tmp_path):
    write_events(tmp_path / "run", "lm loss", range(1, 51), np.linspace(4, 3, 50))
    path = next((tmp_path / "run").glob("*tfevents*"))
    data = bytearray(path.read_bytes())
    pos, starts = 0, []
    while pos < len(data):  # TFRecord framing: uint64 length, 4 CRC bytes, payload, 4 CRC bytes
        starts.append(pos)
        pos += 12 + int.from_bytes(data[pos : pos + 8], "little") + 4
    data[starts[31]] ^= 0xFF  # record 0 is the file version, record k the step k
    path.write_bytes(bytes(data))
    with pytest.warns(L.LogGapWarning, match="fails its checksum"):
        curves = C.read_curves(tmp_path)
    np.testing.assert_array_equal(curves.data["step"], np.arange(1, 31))


# ---------------------------------------------------------------- W&B


@pytest.fixture(scope="module")
def wandb_family(family, tmp_path_factory):
    df, root = family
    directory = tmp_path_factory.mktemp("wandb")
    runs = {}
    for run, rows in df.groupby("run", sort=False):
        config = {k: (v.item() if hasattr(v, "item") else v) for k, v in rows[META].iloc[0].items()}
        runs[run] = {
            "config": config,
            "steps": rows["step"].tolist(),
            "loss": rows["loss"].tolist(),
        }
    write_wandb_runs(directory, runs)
    return df, root, directory


def test_wandb_offline_runs_read_like_the_csv(wandb_family):
    df, root, directory = wandb_family
    folders = sorted((directory / "wandb").glob("offline-run-*"))
    assert len(folders) == len(df["run"].unique())
    from_wandb = C.read_curves(directory)  # size, seed, tpp, tau, steps from each run's config
    from_csv = C.read_curves(root / "curves.csv")
    assert sorted(from_wandb.runs) == sorted(from_csv.runs)
    a = from_wandb.data.astype({"run": str}).sort_values(["run", "step"]).reset_index(drop=True)
    b = from_csv.data.astype({"run": str}).sort_values(["run", "step"]).reset_index(drop=True)
    np.testing.assert_array_equal(a["step"], b["step"])
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-12)  # JSON keeps float64
    for column in META:
        left = from_wandb.meta[column].sort_index().astype(str)
        assert (left == from_csv.meta[column].sort_index().astype(str)).all(), column
    one = C.read_curves(folders[0])  # a single run folder
    assert len(one.runs) == 1


def test_wandb_runs_with_the_same_name(tmp_path):
    run = {"config": {}, "steps": [1, 2, 3], "loss": [4.0, 3.5, 3.2]}
    write_wandb_runs(tmp_path / "a", {"d64": run})
    write_wandb_runs(tmp_path / "b", {"d64": run})
    with pytest.raises(InputError, match="two runs are named 'd64'"):
        C.read_curves([tmp_path / "a", tmp_path / "b"])


def test_resumed_wandb_run_is_one_run(tmp_path):
    """A W&B run resumed from the checkpoint at step 100 writes a second folder, same id."""
    first = {"config": {}, "steps": list(range(1, 151)), "loss": [4.0] * 150, "id": "abc123"}
    again = {"config": {"steps": 300}, "steps": list(range(101, 301)), "loss": [3.0] * 200}
    again |= {"id": "abc123", "name": "d64"}
    write_wandb_runs(tmp_path, {"d64": first, "d64 resumed": again})
    assert len(list((tmp_path / "wandb").glob("offline-run-*abc123"))) == 2
    with pytest.warns(L.LogStitchWarning, match="first at step 101"):
        curves = C.read_curves(tmp_path)
    assert curves.runs == ["d64"] and curves.meta.loc["d64", "steps"] == 300
    data = curves.data
    np.testing.assert_array_equal(data["step"], np.arange(1, 301))
    assert (data["loss"][data["step"] <= 100] == 4.0).all()
    assert (data["loss"][data["step"] > 100] == 3.0).all()


def test_half_written_wandb_file(wandb_family, tmp_path):
    _, _, directory = wandb_family
    source = sorted((directory / "wandb").glob("offline-run-*/run-*.wandb"))[0]
    data = source.read_bytes()
    cut = tmp_path / "run-cut.wandb"
    cut.write_bytes(data[: len(data) // 2])
    run = L.read_wandb_run(cut)
    points = run.scalars["lm loss"]
    assert 0 < len(points) < STEPS
    assert [p[0] for p in points] == list(range(1, len(points) + 1))


def _export_long(df: pd.DataFrame, path: Path, run: str, drop: slice | None = None) -> None:
    rows = df[df["run"] == run]
    table = pd.DataFrame({"_step": rows["step"], "lm loss": rows["loss"], "_runtime": 1.0})
    if drop is not None:
        table = table.drop(table.index[drop])
    table.to_csv(path, index=False)


def test_wandb_history_export_csv_and_json(family, tmp_path):
    df, root = family
    for run in df["run"].unique():
        _export_long(df, tmp_path / f"{run}.csv", run)
    csvs = sorted(tmp_path.glob("*.csv"))
    assert all(L.is_log_source(p) for p in csvs)
    from_export = C.read_curves(csvs, root / "runs.yaml")
    from_csv = C.read_curves(root / "curves.csv")
    np.testing.assert_allclose(
        from_export.data.astype({"run": str}).sort_values(["run", "step"])["loss"].to_numpy(),
        from_csv.data.astype({"run": str}).sort_values(["run", "step"])["loss"].to_numpy(),
        rtol=1e-12,
    )
    rows = df[df["run"] == "s1_s1"]
    lines = [
        json.dumps({"_step": int(s), "train/CE loss": v})
        for s, v in zip(rows["step"], rows["loss"], strict=True)
    ]
    (tmp_path / "s1_s1.jsonl").write_text("\n".join(lines) + "\n")
    curves = C.read_curves(tmp_path / "s1_s1.jsonl")
    assert curves.runs == ["s1_s1"] and len(curves.data) == STEPS


def test_wandb_ui_export_with_several_runs(family, tmp_path):
    df, _ = family
    wide = pd.DataFrame({"Step": np.arange(1, STEPS + 1)})
    for run in ("s1_s1", "s2_s1"):
        loss = df.loc[df["run"] == run, "loss"].to_numpy()
        wide[f"{run} - lm loss"] = loss
        wide[f"{run} - lm loss__MIN"] = loss
        wide[f"{run} - lm loss__MAX"] = loss
    wide.to_csv(tmp_path / "export.csv", index=False)
    curves = C.read_curves(tmp_path / "export.csv")
    assert curves.runs == ["s1_s1", "s2_s1"] and len(curves.data) == 2 * STEPS


def test_wandb_export_with_missing_steps_reports_the_gaps(family, tmp_path):
    df, _ = family
    _export_long(df, tmp_path / "s1_s1.csv", "s1_s1", drop=slice(99, 149))  # steps 100-149
    with pytest.warns(L.LogGapWarning) as caught:
        curves = C.read_curves(tmp_path / "s1_s1.csv")
    message = str(caught[0].message)
    assert "50 logged step(s) missing" in message and "at steps 100-149" in message
    assert len(curves.data) == STEPS - 50


def test_export_with_a_logged_nan_keeps_it(family, tmp_path):
    """An empty cell is a step the export lacks; a NaN is a loss that diverged."""
    path = tmp_path / "r.csv"
    path.write_text("_step,lm loss\n1,4.0\n2,3.9\n3,3.8\n4,NaN\n5,NaN\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", L.LogGapWarning)
        curves = C.read_curves(path)
    assert curves.data["loss"].isna().sum() == 2


def test_json_lines_export_with_missing_keys_reports_the_gaps(tmp_path):
    """A history row without the loss (another metric logged at that step) is no NaN loss."""
    rows = [{"_step": s, "lm loss": 4.0 - s / 100} for s in range(1, 41)]
    rows[10:15] = [{"_step": s, "lr": 0.1} for s in range(11, 16)]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.warns(L.LogGapWarning, match="at steps 11-15"):
        curves = C.read_curves(path)
    assert len(curves.data) == 35 and curves.data["loss"].notna().all()


def test_yaml_sidecar_must_name_runs(tmp_path):
    bad = tmp_path / "runs.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(InputError, match="a runs table in YAML"):
        C.read_table(bad)


def test_is_log_source_leaves_this_projects_inputs_alone(tmp_path):
    (tmp_path / "family" / "runs" / "r1").mkdir(parents=True)
    pd.DataFrame({"run": ["r1"], "step": [1], "loss": [3.0]}).to_parquet(
        tmp_path / "family" / "runs" / "r1" / "curve.parquet"
    )
    assert not L.is_log_source(tmp_path / "family")
    assert not L.is_log_source(tmp_path / "nothing")
    shutil.rmtree(tmp_path / "family")
