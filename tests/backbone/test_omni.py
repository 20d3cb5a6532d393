"""The omni model on real demo batches: placement, the encode/decode split, learning, and the
zero-weighted dummy path of absent modalities."""

from __future__ import annotations

import pytest
import torch

from omniscale.backbone.config import ModelConfig
from omniscale.backbone.omni import OmniModel, scatter_media
from omniscale.encoders.audio import AudioConfig
from omniscale.encoders.vision import VisionConfig
from omniscale.geometry import audio_tokens, vision_tokens
from tests.backbone.omni_batches import GEOMETRY, batch, decoded, render, text_sample, tokenizer

KINDS = ["image", "video", "audio", "image", "video", "audio", "image"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    rendered = render(KINDS, seed=0)
    tok = tokenizer([c for _, _, c in rendered], tmp_path_factory.mktemp("tok") / "tok.json")
    return tok, [decoded(kind, media, caption, tok) for kind, media, caption in rendered]


def make_model(vocab_size: int, seed: int = 0) -> OmniModel:
    torch.manual_seed(seed)
    config = ModelConfig.preset("tiny", vocab_size=vocab_size,
                                vision=VisionConfig.preset("tiny"),
                                audio=AudioConfig.preset("tiny"))
    return OmniModel(config)


def total_loss(out: dict) -> torch.Tensor:
    return out["loss_sum"] / out["n_tokens"] + out["aux"]["router_loss"]


def test_scatter_media_places_blocks_and_clips_overhang():
    embeds_TD = torch.zeros(10, 2)
    items = [torch.full((3, 2), 1.0), torch.full((4, 2), 2.0), torch.full((3, 2), 3.0)]
    items[0][:, 0] = torch.arange(3)  # rows keep their order
    out = scatter_media(embeds_TD, torch.tensor([-1, 4, 9]), items)
    # Block 0 starts before the batch (an SP slice): its rows 1..2 land on 0..1.
    assert out[:2, 0].tolist() == [1.0, 2.0] and out[:2, 1].tolist() == [1.0, 1.0]
    assert (out[2:4] == 0).all()
    assert (out[4:8] == 2.0).all()
    assert (out[8] == 0).all()
    assert (out[9] == 3.0).all()  # block 2 overhangs the end: only its first row lands


def test_scatter_media_keeps_an_sp_slice_block_inside_its_sequence():
    """Sequences 0 = [0, 4), 1 = [4, 7) (an SP slice), 2 = [7, 10): a block of sequence 1 that
    starts before the slice and one that runs past it land only on rows 4..6."""
    embeds_TD = torch.zeros(10, 1)
    items = [torch.full((4, 1), 1.0), torch.full((3, 1), 2.0)]
    cu = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    out = scatter_media(embeds_TD, torch.tensor([2, 6]), items, torch.tensor([1, 1]), cu)
    assert out[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 2, 0, 0, 0]


def test_every_block_lands_on_exactly_its_placeholders(demo):
    tok, samples = demo
    b = batch(samples)
    model = make_model(tok.tokenizer.get_vocab_size())
    d = model.config.d_model
    # Marked embeddings: item m, row r holds 1000*(m+1) + r in every channel.
    items = [(1000.0 * (m + 1) + torch.arange(n, dtype=torch.float32))[:, None].expand(n, d)
             for m, n in enumerate(b.media_num_tokens_M.tolist())]
    seen = {}

    def capture(module, args):
        seen["embeds"] = args[0].detach().clone()

    hook = model.decoder.register_forward_pre_hook(capture)
    with torch.no_grad():
        model.forward_with_media(b, items)
    hook.remove()
    embeds_TD = seen["embeds"]
    expected = model.decoder.embed_tokens(b.input_ids_T).detach().clone()
    owner = torch.full((b.num_tokens,), -1)
    for m, (start, n) in enumerate(zip(b.media_token_start_M.tolist(),
                                       b.media_num_tokens_M.tolist())):
        expected[start:start + n] = items[m]
        owner[start:start + n] = m
    torch.testing.assert_close(embeds_TD, expected)
    markers = torch.tensor(list(tok.marker_ids.values()))
    assert torch.equal(owner >= 0, torch.isin(b.input_ids_T, markers))
    for m, kind in enumerate(b.media_kind_M.tolist()):  # each block sits on its own marker
        assert (b.input_ids_T[owner == m] == tok.marker_ids[("image", "video", "audio")[kind]]
                ).all()


def test_encoders_emit_one_block_per_item_as_if_alone(demo):
    tok, samples = demo
    b = batch(samples)
    model = make_model(tok.tokenizer.get_vocab_size()).eval()
    with torch.no_grad():
        media = model.encode_media(b)
        for m, item in enumerate(media.items):
            alone = model.encode_media(batch([samples[m]])).items[0]
            torch.testing.assert_close(item, alone, rtol=1e-4, atol=1e-5)
    for sample, block in zip(samples, media.items):
        it = sample.media[0]
        want = (audio_tokens(it.frames) if it.kind == "audio"
                else vision_tokens(it.grid_thw, GEOMETRY))
        assert block.shape == (want, model.config.d_model)
    assert media.zero.item() == 0.0


def test_forward_is_encode_then_decode(demo):
    tok, samples = demo
    b = batch(samples)
    model = make_model(tok.tokenizer.get_vocab_size())
    with torch.no_grad():
        whole = model(b)
        media = model.encode_media(b)
        split = model.forward_with_media(b, media.items)
    torch.testing.assert_close(whole["loss_sum"], split["loss_sum"] + media.zero)
    assert whole["n_tokens"] == split["n_tokens"] == (b.labels_T != -100).sum()


def test_wrong_block_length_is_refused(demo):
    tok, samples = demo
    b = batch(samples[:1])
    model = make_model(tok.tokenizer.get_vocab_size())
    b.media_num_tokens_M = b.media_num_tokens_M + 1
    with pytest.raises(ValueError, match="placeholder"):
        model.encode_media(b)


@pytest.mark.parametrize("kinds, idle", [(["image", "video"], ["audio"]),
                                         (["audio"], ["vision"]),
                                         ([], ["vision", "audio"])])
def test_absent_modality_gets_zero_but_existing_grads(demo, kinds, idle):
    tok, samples = demo
    chosen = [s for s in samples if s.media[0].kind in kinds]
    b = batch(chosen or [text_sample(b"a red circle moves left.", tok)])
    model = make_model(tok.tokenizer.get_vocab_size())
    out = model(b)
    with torch.no_grad():  # the dummy term adds exactly zero
        torch.testing.assert_close(out["loss_sum"], model.forward_with_media(
            b, model.encode_media(b).items)["loss_sum"])
    total_loss(out).backward()
    for name in idle:
        for pname, p in getattr(model, name).named_parameters():
            assert p.grad is not None, f"{name}.{pname} got no gradient"
            assert torch.count_nonzero(p.grad) == 0, f"{name}.{pname}"
    for name in {"vision", "audio"} - set(idle):
        assert any(torch.count_nonzero(p.grad) for p in getattr(model, name).parameters())


def test_loss_falls_on_demo_batch(demo):
    tok, samples = demo
    b = batch(samples)
    model = make_model(tok.tokenizer.get_vocab_size())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = total_loss(model(b))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses
