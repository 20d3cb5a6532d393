"""tools/bench/model.py: HF's packed baseline really confines attention to each sequence and
predicts the same tokens as ours, the non-toy preset is no toy, and a tiny run writes the
JSON that tools/bench/all.py reads (parameter counts, provenance, packed check)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from omniscale.tools.bench import model as bench  # noqa: E402
from omniscale.tools.bench.all import headline_rows  # noqa: E402

LENGTHS = [24, 6, 12, 3, 3]  # the mixed batch's proportions, small


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    return bench.hf_model(bench.preset_config("tiny"), torch.float32).eval()


def test_hf_packed_attends_within_each_sequence(tiny_hf):
    _, _, packed = bench.batches(LENGTHS, tiny_hf.config.vocab_size)
    assert bench.hf_packed_check(tiny_hf, LENGTHS, packed) < 1e-5
    # the check has teeth: without the restarting position_ids, attention crosses sequences
    ids_1T, pos_1T, labels_1T = packed
    unpacked = (ids_1T, torch.arange(ids_1T.shape[1])[None], labels_1T)
    assert bench.hf_packed_check(tiny_hf, LENGTHS, unpacked) > 1e-2


def test_hf_packed_loss_is_the_per_sequence_token_mean(tiny_hf):
    ours, _, packed = bench.batches(LENGTHS, tiny_hf.config.vocab_size)
    ids_1T, pos_1T, labels_1T = packed
    # the same predicted tokens as ours: HF shifts the row, the separators stop at boundaries
    assert torch.equal(labels_1T[0, 1:], ours[4][:-1])
    with torch.no_grad():
        whole = tiny_hf(input_ids=ids_1T, position_ids=pos_1T, labels=labels_1T,
                        output_router_logits=False, use_cache=False).loss
        total, start = 0.0, 0
        for n in LENGTHS:
            seq = ids_1T[:, start:start + n]
            total += tiny_hf(input_ids=seq, labels=seq, output_router_logits=False,
                             use_cache=False).loss * (n - 1)
            start += n
    assert whole == pytest.approx(float(total) / (sum(LENGTHS) - len(LENGTHS)), abs=1e-5)


def test_the_medium_preset_is_no_toy_and_hf_matches_its_size():
    config = bench.preset_config("medium")
    with torch.device("meta"):  # shapes only: no memory, no init
        hf = bench.hf_model(config, torch.float32)
    assert config.param_count() >= 100_000_000
    assert sum(p.numel() for p in hf.parameters()) == config.param_count()


@pytest.mark.slow  # ~6 s on 2 quiet cores (builds and steps three tiny models)
def test_a_tiny_run_writes_what_bench_all_reads(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert bench.main(["--presets", "tiny", "--tokens", "128", "--warmup", "0", "--iters", "1",
                       "--hf-experts", "grouped_mm", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"git_commit", "git_dirty", "load_avg_at_start", "cpus"} <= set(result)
    assert result["command"].startswith("tools/bench/model.py --presets tiny")
    equal, mixed = result["results"]
    for row in (equal, mixed):
        assert row["params_total"] == row["params_ours"] == row["params_hf"] == 1_149_696
        assert row["params_active"] == 559_872
    assert equal["hf_packed_check"] is None and "ratio_padded" not in equal
    assert mixed["hf_packed_check"]["max_abs_logit_diff"] < 1e-5
    assert mixed["hf_layout"].startswith("packed [1, 128]")
    assert mixed["ratio"] == pytest.approx(mixed["ours_tokens_per_s"] / mixed["hf_tokens_per_s"])
    rows = {r["metric"]: r for r in headline_rows("model", result)}
    assert rows["tiny mixed: tokens/s ours vs HF packed (block-causal)"]["ratio"] \
        == mixed["ratio"]
    assert rows["tiny mixed: ratio vs HF padded (information)"]["value"] \
        == mixed["ratio_padded"]
    assert rows["tiny: parameters, total"]["value"] == 1_149_696
    printed = capsys.readouterr().out
    assert "| tiny | 1.1 M | 0.6 M | mixed 64+16+32+8+8 | packed [1, 128]" in printed
