"""The omni step's encoder plan + reshard: two processes train exactly what one does.

With the same spec and global batch size the plane draws the same global batches for 1 and 2
ranks; the 2-rank run encodes each media item on the rank the encoder plan names, moves the
embeddings with the reshard all-to-all and runs backward in fixed phases. Every parameter's
gradient (``debug.dump_grads_at_step``: gathered from the FSDP shards; encoders, router,
experts and embeddings alike), the losses and the gradient norms must match the single
process (sums in another order: within float tolerance), router losses included: the z-loss is
a mean over the global batch's tokens, so it matches even when the two runs pack their
micro-batches differently (the aux loss's load fractions are a micro-batch's own, so it
matches where the packing is the same).
"""

from __future__ import annotations

from tests.tools.train_runs import (
    DUMP,
    assert_same_gradients,
    assert_same_rows,
    run_omni,
)


def test_two_ranks_with_encoder_plan_and_reshard_match_one(demo, tmp_path, omni_one):
    """The demo's first steps (text and images), aux and z router losses on."""
    one, g_one = omni_one  # 4 steps of one process (tests/tools/conftest.py)
    one = one[:3]
    two, g_two = run_omni(demo, tmp_path / "two", 2)
    # the same micro-batches, 2 on the one rank and 1 on each of two: the aux loss's load
    # fractions are per micro-batch, so only then is it the same loss
    assert [r["micro_batches"] for r in one] == [2, 2, 2]
    assert [r["micro_batches"] for r in two] == [1, 1, 1]
    assert_same_gradients(g_one, g_two)
    assert_same_rows(one, two)
    # the 2-rank plan moved media between ranks (otherwise the reshard was not exercised)
    assert sum(r["media_items_moved"] for r in two) > 0
    assert all(r["media_items_moved"] == 0 for r in one)
    # the cost refit ran at step 3 (deterministic run: logged, not sent to the plane)
    assert "cost_refit" in two[2] and "cost_refit" not in two[1]
    assert two[2]["cost_refit"] is None or "applies_at_step" not in two[2]["cost_refit"]
    events = list((tmp_path / "two" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0  # the same metrics for TensorBoard
    row = two[-1]
    assert abs(sum(row["mix_target"].values()) - 1.0) < 1e-5
    assert sum(row["mix_tokens"].values()) == row["tokens"]


def test_every_modality_and_z_loss_over_other_packings_match_one(demo, tmp_path,
                                                                 every_source_one):
    """Every source from step 0 (video and audio too, so both encoders train): the plane
    packs the two ranks' micro-batches otherwise than the one rank's, and the z-loss -- a
    mean over the global batch's tokens -- still gives one process's gradients (weighted per
    micro-batch by its target tokens, as before issue 15, the routers' gradients were 7%
    apart). The aux loss is off: its load fractions are a micro-batch's own, so another
    packing is another loss."""
    extra, one, g_one = every_source_one  # 4 steps of one process (tests/tools/conftest.py)
    one = one[:3]
    two, g_two = run_omni(demo, tmp_path / "two", 2, **extra)
    # another packing: at some step rank 0 of two holds as many micro-batches as the one rank
    assert any(a["micro_batches"] == b["micro_batches"] for a, b in zip(one, two))
    assert {"video_caption", "audio_caption"} <= one[DUMP]["mix_samples"].keys()
    assert_same_gradients(g_one, g_two, trained=("vision.", "audio.", "decoder."))
    assert_same_rows(one, two)
    assert sum(r["media_items_moved"] for r in two) > 0
