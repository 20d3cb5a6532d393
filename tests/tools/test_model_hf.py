"""Starting from a Hugging Face model and handing one back: ``model.init_from.backbone`` trains
from a (locally built, random) Qwen3-MoE's weights, ``omniscale model export-hf`` writes the
trained decoder as a checkpoint transformers loads with no custom code, with our logits;
``omniscale model info`` prices it."""

from __future__ import annotations

import json

import pytest
import torch

from omniscale.dataplane.spec import load_spec
from omniscale.encoders.hf_files import CheckpointDir
from omniscale.errors import UserError
from omniscale.tools.cli import main
from omniscale.tools.train import checkpoint
from omniscale.tools.train.build import build_model, model_config
from omniscale.tools.train.launch import resolve_config, train

transformers = pytest.importorskip("transformers")

HF_VOCAB = 320  # below the demo tokenizer's ids: the run grows the table (mean rows)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "qwen3-moe"
    config = transformers.Qwen3MoeConfig(
        vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(path)
    # its own small byte-level BPE, with a special token of its own and none of ours
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["a small model reads small texts"] * 4, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """A tiny Qwen2-VL (its vision tower on the demo's patch geometry, merging to the decoder's
    width) and a tiny Whisper (the demo's 80 mel bins), saved; (paths, the HF models)."""
    root = tmp_path_factory.mktemp("towers")
    torch.manual_seed(1)
    vl = transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                           patch_size=8, temporal_patch_size=2, spatial_merge_size=2),
        text_config=dict(vocab_size=64, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 10000.0})))
    whisper = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        num_mel_bins=80, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
        vocab_size=64, max_target_positions=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=1, decoder_start_token_id=2, begin_suppress_tokens=None))
    vl.save_pretrained(root / "qwen2-vl")
    whisper.save_pretrained(root / "whisper")
    return root / "qwen2-vl", root / "whisper", vl, whisper


def _sets(demo, out, hf, **kw) -> list[str]:
    base = {"data.spec": demo / "mix.yaml", "data.workers": 0, "data.global_batch_tokens": 4096,
            "data.micro_batch_tokens": 4096, "optim.warmup_steps": 1, "eval.enabled": False,
            "model.init_from.backbone": hf, "output_dir": out}
    return [f"{k}={v}" for k, v in {**base, **kw}.items()]


def _trained(run_dir):
    cfg, _ = resolve_config(None, str(run_dir), [])
    spec = load_spec(cfg.data.spec)
    mcfg = model_config(cfg, spec.media, spec.tokenizer)
    model = build_model(mcfg, cfg.seed, torch.device("cpu"))
    checkpoint.load(checkpoint.latest(run_dir)[1], model, None)
    return model.eval(), mcfg


def test_a_run_starts_from_the_checkpoint_s_weights(demo, qwen3_moe, towers, tmp_path):
    """One step at learning rate ~0: the run's decoder is the checkpoint's, rows beyond its
    vocabulary the mean of its rows; its vision tower Qwen2-VL's, its audio encoder Whisper's
    (with a new projector to the decoder's width)."""
    vl_path, whisper_path, vl, whisper = towers
    train("configs/demo_omni.yaml", progress=False,
          sets=_sets(demo, tmp_path / "r", qwen3_moe, steps=1,
                     **{"optim.lr": 1e-30, "optim.min_lr": 0.0,
                        "model.init_from.vision": vl_path,
                        "model.init_from.audio": whisper_path,
                        "model.fresh_projector": True}))  # Whisper has none
    model, mcfg = _trained(tmp_path / "r")
    assert (mcfg.vision.norm, mcfg.audio.layout) == ("layer", "whisper")
    for ours, theirs in ((model.vision.blocks[0].qkv.weight, vl.model.visual.blocks[0].attn.qkv),
                         (model.vision.merger.fc2.weight, vl.model.visual.merger.mlp[2]),
                         (model.audio.blocks[1].up.weight, whisper.model.encoder.layers[1].fc1)):
        assert torch.allclose(ours, theirs.weight, atol=1e-6)
    assert model.audio.projector.weight.shape == (64, 32)  # Whisper has none: a new one
    # handed back: each tower a checkpoint transformers loads on its own -- the Qwen2-VL
    # tower, the Whisper encoder (its new projector beside it)
    out = tmp_path / "exported"
    assert main(["model", "export-hf", str(tmp_path / "r"), "--out", str(out)]) == 0
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    tower = Qwen2VisionTransformerPretrainedModel.from_pretrained(out / "vision")
    want = vl.model.visual.state_dict()
    assert tower.state_dict().keys() == want.keys()
    for name, value in tower.state_dict().items():
        assert torch.allclose(value, want[name], atol=1e-6), name
    from safetensors.torch import load_file
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    encoder = WhisperEncoder.from_pretrained(out / "audio")
    want = whisper.model.encoder.state_dict()
    assert encoder.state_dict().keys() == want.keys()
    for name, value in encoder.state_dict().items():
        assert torch.allclose(value, want[name], atol=1e-6), name
    head = load_file(out / "audio" / "projector.safetensors")
    assert torch.equal(head["linear.weight"], model.audio.projector.weight.detach())
    assert not any(out.glob("*_tower.safetensors")) and not (out / "omniscale_towers.json").exists()
    # ... and a new run starts from the towers handed back, the projector included
    train("configs/demo_omni.yaml", progress=False,
          sets=_sets(demo, tmp_path / "again", qwen3_moe, steps=1,
                     **{"optim.lr": 1e-30, "optim.min_lr": 0.0,
                        "model.init_from.vision": out / "vision",
                        "model.init_from.audio": out / "audio"}))
    again, _ = _trained(tmp_path / "again")
    for tower in ("vision", "audio"):
        started = getattr(again, tower).state_dict()
        for name, value in getattr(model, tower).state_dict().items():
            assert torch.allclose(started[name], value, atol=1e-6), (tower, name)
    ckpt = CheckpointDir(qwen3_moe)
    table = ckpt.get("model.embed_tokens.weight")
    assert mcfg.vocab_size > HF_VOCAB and mcfg.d_model == 64 and mcfg.moe.num_experts == 4
    ours = model.decoder.embed_tokens.weight.detach()
    assert torch.allclose(ours[:HF_VOCAB], table, atol=1e-6)
    assert torch.allclose(ours[HF_VOCAB:], table.mean(0).expand_as(ours[HF_VOCAB:]), atol=1e-6)
    experts = model.decoder.layers[1].ffn.experts.down_proj.detach()
    assert torch.allclose(experts[3], ckpt.get("model.layers.1.mlp.experts.3.down_proj.weight"),
                          atol=1e-6)

    # the same start through `model import-hf` (a DCP checkpoint, read shard by shard)
    init = tmp_path / "init"
    assert main(["model", "import-hf", str(qwen3_moe), "--out", str(init),
                 "--vocab-size", str(mcfg.vocab_size)]) == 0
    train("configs/demo_omni.yaml", progress=False,
          sets=_sets(demo, tmp_path / "i", init, steps=1,
                     **{"optim.lr": 1e-30, "optim.min_lr": 0.0}))
    imported, _ = _trained(tmp_path / "i")
    for (name, a), (_, b) in zip(model.decoder.state_dict().items(),
                                 imported.decoder.state_dict().items()):
        assert torch.equal(a, b), name
    # its tokenizer gained our special tokens after its own ids, which keep their meaning
    from tokenizers import Tokenizer

    from omniscale.layout import SPECIAL_TOKENS
    from omniscale.loaders.decode_text import load_tokenizer

    before = Tokenizer.from_file(str(qwen3_moe / "tokenizer.json"))
    after = load_tokenizer(init / "tokenizer.json")  # what our loaders require of one
    n = before.get_vocab_size()
    assert sorted(after.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS) == \
        list(range(n, n + len(SPECIAL_TOKENS)))
    text = "a small model reads <|endoftext|>"
    assert after.tokenizer.encode(text).ids == before.encode(text).ids
    small = tmp_path / "init-small"
    assert main(["model", "import-hf", str(qwen3_moe), "--out", str(small)]) == 0
    with pytest.raises(UserError, match=rf"^model.init_from.backbone {small}: cannot load .*"
                                        rf"import again with --vocab-size {mcfg.vocab_size}\)$"):
        train("configs/demo_omni.yaml", progress=False,
              sets=_sets(demo, tmp_path / "s", small, steps=1))


def test_pipeline_stages_start_from_the_checkpoint_s_layers(demo, qwen3_moe, tmp_path):
    """Two stages (the lm task): each fills only the layers it holds, by their names in the
    whole model (stage 0 the embeddings and layer 0, stage 1 layer 1 and the head), from the
    safetensors and from ``model import-hf``'s DCP checkpoint alike."""
    ckpt, init, vocab = CheckpointDir(qwen3_moe), tmp_path / "init", None
    for name in ("hf", "dcp"):
        if name == "dcp":  # the vocabulary the first run grew to
            assert main(["model", "import-hf", str(qwen3_moe), "--out", str(init),
                         "--vocab-size", str(vocab)]) == 0
        train("configs/demo_lm.yaml", nproc=2, progress=False, sets=_sets(
            demo, tmp_path / name, qwen3_moe if name == "hf" else init, steps=1, **{
                "data.spec": demo / "lm.yaml", "parallel.pp": 2, "optim.lr": 1e-30,
                "optim.min_lr": 0.0}))
        model, mcfg = _trained(tmp_path / name)
        assert mcfg.vocab_size > HF_VOCAB and mcfg.n_layers == 2
        vocab, decoder = mcfg.vocab_size, model.decoder
        for ours, theirs in (
                (decoder.embed_tokens.weight[:HF_VOCAB], "model.embed_tokens.weight"),
                (decoder.layers[0].attn.q_proj.weight, "model.layers.0.self_attn.q_proj.weight"),
                (decoder.layers[1].ffn.experts.down_proj[2],
                 "model.layers.1.mlp.experts.2.down_proj.weight"),
                (decoder.lm_head.weight[:HF_VOCAB], "lm_head.weight")):
            assert torch.allclose(ours.detach(), ckpt.get(theirs), atol=1e-6), (name, theirs)


def test_train_export_and_load_with_transformers(demo, qwen3_moe, tmp_path, capsys):
    train("configs/demo_omni.yaml", progress=False,
          sets=_sets(demo, tmp_path / "r", qwen3_moe, steps=5))
    assert main(["model", "export-hf", str(tmp_path / "r"), "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "vision_tower.safetensors", "audio_tower.safetensors",
            "omniscale_towers.json"} <= {p.name for p in out.iterdir()}
    model, mcfg = _trained(tmp_path / "r")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, mcfg.vocab_size, (37,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cu = torch.tensor([0, 37], dtype=torch.int32)
        hidden, _ = model.decoder(model.decoder.embed_tokens(ids), torch.arange(37), cu, 37)
        ours = model.decoder.logits(hidden)
        theirs = hf(ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4
    start = CheckpointDir(qwen3_moe).get("model.layers.0.self_attn.q_proj.weight")
    assert not torch.allclose(hf.model.layers[0].self_attn.q_proj.weight, start)  # trained
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"

    capsys.readouterr()
    assert main(["model", "export-hf", str(tmp_path / "r"), "--out", str(out)]) != 0
    assert capsys.readouterr().err == f"omniscale: error: {out}: already exists (give a new " \
                                      "directory)\n"


def test_model_info_prices_the_checkpoint(qwen3_moe, capsys):
    assert main(["model", "info", str(qwen3_moe), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "Qwen3MoeForCausalLM" and info["experts"] == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_moe)
    assert info["parameters"] == sum(p.numel() for p in hf.parameters())  # an independent count
    assert info["layers"] == 2 and info["top_k"] == 2
    # by hand, per layer: q 64·64, k and v 64·32, o 64·64, q/k norms 2·16, two norms 2·64,
    # router 64·4, two experts 2·3·64·32; plus the head 320·64 (a matmul; the table is not)
    layer = 4096 + 2 * 2048 + 4096 + 32 + 128 + 256 + 12288
    assert info["cost_alpha"] == 6 * (2 * layer + HF_VOCAB * 64)
