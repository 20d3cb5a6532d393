"""``omniscale report``: plots and index.html from synthetic metrics.jsonl rows."""

from __future__ import annotations

import json
import math
import re

import pytest
from PIL import Image

from omniscale.tools.cli import main
from omniscale.tools.report import build_report
from omniscale.tools.report.plots import PLOTS
from omniscale.tools.report.series import smoothed

ALL_PNGS = [name for name, _ in PLOTS]


def full_row(step: int, ranks: int = 4) -> dict:
    """A row with every field the report draws, as tools/train/loop.py (and its successors)
    write them."""
    text_weight = 0.6 - 0.2 * min(step / 20, 1)
    return {
        "step": step, "loss": 9.0 * math.exp(-step / 15) + 2.0, "router_loss": 0.01,
        "lr": 3e-4, "tokens": 4096, "tokens_per_s": 5000.0 + 10 * step, "step_s": 0.8,
        "measured_step_s": 0.7, "predicted_step_s": None if step == 0 else 0.72,
        "data_wait_frac": 0.05,
        "source_loss": {"text": 8.0 - 0.1 * step, "image": 9.0 - 0.1 * step},
        "mix_tokens": {"text": int(4096 * text_weight), "image": int(4096 * (1 - text_weight))},
        "mix_target": {"text": text_weight, "image": 1 - text_weight, "audio": 0.0},
        "rank_compute_s": [0.6 + 0.01 * r for r in range(ranks)],
        "rank_predicted_cost": [1e8 + 1e6 * r for r in range(ranks)],
        "rank_speed": [1.0 - 0.01 * r for r in range(ranks)],
        "imbalance_measured": 1.02, "imbalance_predicted": 1.01, "compute_clock": "cpu",
        "balance": "omniscale", "predicted_step_cost": 1.0e8,
        "baseline_predicted_step_cost": 1.2e8, "baseline_policy": "kk_cost",
        "expert_load": [[100 + e * (layer + 1) for e in range(8)] for layer in range(2)],
        "expert_load_max_over_mean": [1.1, 1.2],
        # eval.every = 10: the held-out figures on the rows of steps 9, 19, 29
        **({"eval": {"image_caption/accuracy": 0.1 + step / 100, "image_caption/tokens": 700}}
           if step % 10 == 9 else {}),
    }


def write_metrics(run_dir, rows, extra_lines=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run_dir


def write_config(run_dir, accounting: str) -> None:
    """config.yaml naming a mixing spec, as `omniscale train` writes it (the report reads only
    the spec's accounting)."""
    spec = run_dir / "mix.yaml"
    spec.write_text(f"accounting: {accounting}\nsources: []\n")
    (run_dir / "config.yaml").write_text(f"task: omni\ndata:\n  spec: {spec}\n")


def assert_valid_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] > 200 and image.size[1] > 100


def test_every_plot_from_full_rows(tmp_path):
    run = write_metrics(tmp_path / "run", [full_row(s) for s in range(30)])
    write_config(run, "tokens")
    (run / "eval.json").write_text(json.dumps(
        {"image_caption": {"samples": 32, "tokens": 700, "accuracy": 0.66,
                           "chance_majority": 0.1}}))
    index = build_report(run)
    assert index == run / "report" / "index.html"
    page = index.read_text()
    for name in ALL_PNGS:
        assert_valid_png(index.parent / name)
        assert f"src='{name}'" in page
    assert "skipped:" not in page and "not recorded" not in page
    assert "accounting is unknown" not in page
    assert "30 (steps 0–29)" in page
    assert f"{full_row(29)['loss']:.4g}" in page  # final loss in the summary
    assert "placement policy (data.balance)</td><td>omniscale" in page
    assert "predicted gain over the best baseline (Σ step cost)</td><td>1.200×" in page
    assert_valid_png(run / "report" / "balancer.png")
    assert "mean measured imbalance of compute time (max/mean)" in page
    assert "mean tokens/s" in page
    assert "image_caption" in page and "0.66" in page and "from eval.json" in page
    # audio: wanted (weight 0) but never drawn, still reported beside the others
    assert re.search(r"final cumulative token share: text 0\.\d+ \(target 0\.\d+\), "
                     r"image .*audio 0\.000", page)


@pytest.mark.parametrize("with_samples", [True, False])
def test_mixture_counts_in_the_specs_unit(tmp_path, with_samples):
    """Weights that count samples are compared with sample shares, not token shares."""
    rows = [full_row(s) for s in range(5)]
    for row in rows:
        if with_samples:
            row["mix_samples"] = {"text": 3, "image": 1}
    run = write_metrics(tmp_path / "run", rows)
    write_config(run, "samples")
    page = build_report(run).read_text()
    assert_valid_png(run / "report" / "mixture.png")
    if with_samples:
        assert "final cumulative sample share: text 0.750" in page
    else:
        assert "rows have no `mix_samples`: token shares shown" in page
        assert "final cumulative token share" in page


def test_missing_fields_skip_their_plots_with_a_note(tmp_path):
    run = write_metrics(tmp_path / "run", [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(5)])
    out = tmp_path / "elsewhere"
    assert main(["report", str(run), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert_valid_png(out / "loss.png")
    for name in ALL_PNGS[1:]:
        assert not (out / name).exists()
        assert f"src='{name}'" not in page
    for note in ("per-source loss not recorded", "skipped: no throughput fields",
                 "skipped: rows have no `mix_tokens`", "skipped: no per-rank load fields",
                 "skipped: rows have no `expert_load`", "Not shown: no eval.json"):
        assert note in page, note
    assert "final loss" in page and "mean tokens/s" not in page


def test_odd_rows_are_tolerated(tmp_path):
    """A resumed run mixing trainer versions: fields appear part-way, rank counts change,
    values are null or the wrong type. Nothing raises; what can be drawn is."""
    rows = [{"step": 0}, {"loss": "nan?", "tokens_per_s": None}]  # second row: no step at all
    rows += [dict(full_row(s, ranks=2 if s < 6 else 4), expert_load_max_over_mean=None)
             for s in range(2, 10)]
    rows[3]["rank_compute_s"] = "oops"
    rows[4]["expert_load"] = [[1, "x", 3], "not a layer"]
    rows[5]["mix_tokens"] = {}
    rows[6]["mix_target"] = None
    rows[7]["source_loss"] = {"text": None}
    rows[8]["loss"] = float("nan")
    run = write_metrics(tmp_path / "run", rows)
    (run / "result.json").write_text(json.dumps({"steps": 10, "eval": None}))
    index = build_report(run)
    page = index.read_text()
    for name in ALL_PNGS:
        assert_valid_png(index.parent / name)
    assert "could not draw" not in page
    assert "result.json holds no evaluation results" in page


def test_long_run_heatmaps_are_binned(tmp_path):
    rows = [{"step": s, "rank_compute_s": [1.0, 1.0 + (s % 7) / 10],
             "expert_load": [[s % 5 + 1, 3]]} for s in range(3200)]
    index = build_report(write_metrics(tmp_path / "run", rows))
    assert_valid_png(index.parent / "rank_load.png")
    assert_valid_png(index.parent / "expert_load.png")


def test_eval_from_result_json(tmp_path):
    run = write_metrics(tmp_path / "run", [{"step": 0, "loss": 3.0}])
    (run / "result.json").write_text(json.dumps(
        {"steps": 1, "eval": {"audio_caption": {"accuracy": 0.25, "samples": 1234}}}))
    page = build_report(run).read_text()
    assert "from result.json" in page and "audio_caption" in page and "1,234" in page


def test_profiler_traces_are_linked_relative_to_the_page(tmp_path):
    run = write_metrics(tmp_path / "run", [full_row(s) for s in range(3)])
    assert "Profiler traces" not in build_report(run).read_text()  # none: no section
    (run / "profile").mkdir()
    for rank in (0, 1):
        (run / "profile" / f"trace-rank{rank}-steps-1-2.json").write_text('{"traceEvents": []}')
    (run / "profile" / "notes.txt").write_text("not a trace")
    page = build_report(run).read_text()
    assert "href='../profile/trace-rank0-steps-1-2.json'" in page
    assert "href='../profile/trace-rank1-steps-1-2.json'" in page
    assert "notes.txt" not in page and "ui.perfetto.dev" in page
    elsewhere = build_report(run, tmp_path / "pages" / "r").read_text()  # --out
    assert "href='../../run/profile/trace-rank0-steps-1-2.json'" in elsewhere


def test_a_skipped_plot_leaves_no_stale_png(tmp_path):
    run = write_metrics(tmp_path / "run", [full_row(s) for s in range(3)])
    out = build_report(run).parent
    assert (out / "mixture.png").exists()
    write_metrics(run, [{"step": 0, "loss": 1.0}])
    build_report(run)
    assert not (out / "mixture.png").exists()


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, r"run: no such run directory"),
    (lambda d: d.mkdir(), r"run/metrics\.jsonl: not found"),
    (lambda d: write_metrics(d, [], ["", "  "]), r"run/metrics\.jsonl: empty"),
    (lambda d: write_metrics(d, [{"step": 0, "loss": 1.0}], ['{"step": 1, "loss": 2.'
                                                             '{"step": 2}']),
     r"run/metrics\.jsonl:2: not valid JSON"),
    (lambda d: write_metrics(d, [{"step": 0}], ["[1, 2]"]),
     r"run/metrics\.jsonl:2: expected a JSON object"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_smoothing_is_centred_and_skips_gaps():
    import numpy as np

    values = np.r_[np.arange(100.0), np.nan]
    out = smoothed(values)
    assert abs(out[50] - 50.0) < 1e-9  # a line stays itself: no lag behind a trend
    assert np.isfinite(out[-1])  # the gap takes its window's mean, it does not spread NaN


def test_rank_speeds_show_a_slowed_rank_s_share_falling_and_the_step_recovering(tmp_path):
    """Rank 1 at half speed from step 4, told after step 5 and planned for from step 6: the
    plot is drawn and the page names each change the plane was told, in order."""
    rows = []
    for step in range(10):
        slow = 4 <= step
        planned = step >= 6
        rows.append({**full_row(step, ranks=2),
                     "rank_speed": [1.0, 0.5 if slow else 1.0],
                     "rank_predicted_cost": [2.0, 1.0] if planned else [1.0, 1.0],
                     "step_s": 2.0 if slow and not planned else 1.5 if planned else 1.0})
    rows[5]["rank_speeds_sent"] = {"applies_at_step": 6, "speeds": [1.0, 0.5]}
    rows[8]["rank_speeds_sent"] = {"applies_at_step": 9, "speeds": []}
    run = write_metrics(tmp_path / "run", rows)
    page = build_report(run).read_text()
    assert_valid_png(run / "report" / "rank_speeds.png")
    assert page.index("measured after step 5, planned from step 6: 1.00, 0.50") < \
        page.index("measured after step 8, planned from step 9: equal")


def test_rank_speeds_are_skipped_with_a_note_on_one_rank(tmp_path):
    run = write_metrics(tmp_path / "run", [full_row(s, ranks=1) for s in range(3)])
    page = build_report(run).read_text()
    assert not (run / "report" / "rank_speeds.png").exists()
    assert "skipped: no rank speeds recorded" in page
