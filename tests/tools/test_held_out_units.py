"""Held-out evaluation inside the ranks, piece by piece (issue #46): when it runs, how a data
rank's slice of the micro-batches is chosen and padded, how one rank's counts are scored and
summed with its peers', the precision it runs at, and what the run keeps of it. The multi-rank
runs (tests/tools/test_train_eval.py) compare whole results with one process's evaluation; here
each rule is checked against a case worked out by hand, in one process, the peers' counts
handed in as the gather would return them."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from omniscale.layout import IGNORE_INDEX
from omniscale.loaders.collate import collate
from omniscale.tools.train import collectives
from omniscale.tools.train.held_out import HeldOut, evaluates_in_ranks, flat

X = IGNORE_INDEX


def _cfg(every=0, steps=10, enabled=True, eval_spec="eval.yaml", precision="auto",
         task="omni"):
    return SimpleNamespace(eval=SimpleNamespace(enabled=enabled, every=every), steps=steps,
                           data=SimpleNamespace(eval_spec=eval_spec), task=task,
                           parallel=SimpleNamespace(mixed_precision=precision))


def _held(cfg=None, rank=0, world=1, run_dir=None, vocab_size=8):
    held = HeldOut.__new__(HeldOut)  # no held-out set to read: the parts under test only
    held.cfg, held.run_dir, held.vocab_size = cfg or _cfg(), run_dir, vocab_size
    held.ctx = SimpleNamespace(rank=rank, world=world, pipeline=None, tp_rank=0,
                               sum_group=None)
    held.spec = SimpleNamespace(media=None)
    held.sets = None
    return held


@pytest.mark.parametrize("every, due_at", [
    (3, [3, 6, 9, 10]),  # every 3rd step, and the run's last
    (0, [10]),           # 0: only after the last step
    (5, [5, 10]),        # the last step is due once, not twice
])
def test_evaluation_is_due_every_n_steps_and_after_the_last(every, due_at):
    held = _held(_cfg(every=every, steps=10))
    assert [done for done in range(1, 11) if held.due(done)] == due_at


@pytest.mark.parametrize("enabled, spec, want", [
    (True, "eval.yaml", True), (False, "eval.yaml", False), (True, None, False),
    (False, None, False)])
def test_ranks_evaluate_only_when_enabled_and_given_a_held_out_spec(enabled, spec, want):
    assert evaluates_in_ranks(_cfg(enabled=enabled, eval_spec=spec)) is want


class _Recorder:
    """Stands in for the task's scoring method: keeps the slice it was handed."""

    def __call__(self, model, mine, samples):
        self.mine, self.samples = mine, samples
        return {"samples": samples}


def _mb(name, tokens=4):
    return SimpleNamespace(name=name, num_tokens=tokens)


@pytest.mark.parametrize("rank, want", [
    # 7 micro-batches over 3 data ranks: rank r scores every 3rd from r, and every rank
    # runs ceil(7 / 3) = 3 forwards -- the short slices padded at the end
    (0, [0, 3, 6]), (1, [1, 4, None]), (2, [2, 5, None])])
def test_a_data_rank_scores_every_worldth_micro_batch_padded_to_the_longest_slice(rank, want):
    held = _held(rank=rank, world=3)
    held.token_accuracy = recorder = _Recorder()
    mbs = [_mb(f"mb{i}") for i in range(7)]
    assert held._score(None, mbs, samples=11) == {"samples": 11}
    assert [i for i, _ in recorder.mine] == want
    for i, mb in recorder.mine:
        if i is None:  # a placeholder: one token whose label is ignored
            assert mb.num_tokens == 1 and mb.labels_T.tolist() == [X]
        else:
            assert mb is mbs[i]


def test_an_empty_micro_batch_in_a_slice_is_scored_as_a_placeholder_at_its_index():
    held = _held(rank=0, world=2)
    held.token_accuracy = recorder = _Recorder()
    empty = collate([], None)
    mbs = [_mb("a"), _mb("b"), empty, _mb("d")]
    held._score(None, mbs, samples=4)
    (i0, mb0), (i2, mb2) = recorder.mine
    assert (i0, i2) == (0, 2) and mb0 is mbs[0]
    # the empty batch keeps its index (it is real, not padding) but runs a one-token forward
    assert mb2.num_tokens == 1 and mb2.labels_T.tolist() == [X]


class _Decoder(nn.Module):
    """A model whose hidden states are its logits: each token's hidden state is a one-hot
    of the micro-batch's ``pred_T`` (what the test says the model predicts)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.decoder = SimpleNamespace(logits=lambda hidden_TD: hidden_TD)

    def encode_media(self, mb):
        return SimpleNamespace(items=None)

    def decode(self, mb, items):
        return nn.functional.one_hot(mb.pred_T, 8).float(), None


def _scored_mb(pred, labels):
    return SimpleNamespace(pred_T=torch.tensor(pred), labels_T=torch.tensor(labels),
                           num_tokens=len(pred))


def test_one_ranks_accuracy_counts_its_real_micro_batches_and_not_the_padding(monkeypatch):
    gathered = []
    monkeypatch.setattr(collectives, "gather_held_out_counts",
                        lambda counts, group: gathered.append(counts) or [counts])
    held = _held(world=1, vocab_size=8)
    mine = [(0, _scored_mb([1, 2, 3], [1, 2, 0])),   # 2 of 3 right
            (4, _scored_mb([5, 5], [5, X])),         # 1 of 1 scored
            (None, _scored_mb([7, 7], [7, 7]))]      # padding: not counted though right
    result = held.token_accuracy(_Decoder(), mine, samples=6)
    assert gathered == [(3, 4, Counter({1: 1, 2: 1, 0: 1, 5: 1}))]
    assert result == {"samples": 6, "tokens": 4, "accuracy": 0.75, "chance_uniform": 1 / 8,
                      "chance_majority": 0.25}


def test_the_result_sums_every_peers_counts(monkeypatch):
    # this rank: 3 of 4; its peer: 1 of 6, five of them token 2 -> 4 of 10 over both, the
    # majority token (2: 5 of the 10 targets) at 0.5
    peer = (1, 6, Counter({2: 5, 4: 1}))
    monkeypatch.setattr(collectives, "gather_held_out_counts",
                        lambda counts, group: [counts, peer])
    held = _held(world=2, vocab_size=4)
    result = held._accuracy(9, 3, 4, Counter({1: 2, 3: 2}))
    assert result == {"samples": 9, "tokens": 10, "accuracy": 0.4, "chance_uniform": 0.25,
                      "chance_majority": 0.5}


@pytest.mark.parametrize("precision, bf16", [("bf16", True), ("fp32", False),
                                              ("auto", False)])  # auto: bf16 on CUDA only
def test_evaluation_runs_in_bf16_exactly_when_the_run_trains_in_it_on_this_device(
        precision, bf16):
    held = _held(_cfg(precision=precision))
    with held._precision(nn.Linear(2, 2)):
        assert torch.is_autocast_enabled("cpu") is bf16
        if bf16:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_flat_names_each_metric_by_source_and_leaves_out_the_raw_sums():
    results = {"captions": {"accuracy": 0.5, "tokens": 10, "loss_sum": 3.0, "n_targets": 4},
               "clips": {"loss": 0.25}}
    assert flat(results) == {"captions/accuracy": 0.5, "captions/tokens": 10,
                             "clips/loss": 0.25}


class _Scoring(HeldOut):
    """Scores each source by a fixed row; records the model's mode while it scores."""

    def token_accuracy(self, model, mine, samples):
        self.modes.append(model.training)
        return {"samples": samples}


@pytest.mark.parametrize("rank, done, written", [(0, 10, True), (0, 5, False),
                                                 (1, 10, False)])
def test_the_last_steps_results_are_written_by_rank_0_and_the_model_left_training(
        tmp_path, monkeypatch, rank, done, written):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    held = _Scoring.__new__(_Scoring)
    held.__dict__.update(vars(_held(_cfg(every=5, steps=10), run_dir=tmp_path)))
    held.modes = []
    held.sets = {"captions": ([_mb("a")], 3), "chat": ([_mb("b")], 2)}
    model = nn.Linear(2, 2)
    results = held.evaluate(model, done)
    assert results == {"captions": {"samples": 3}, "chat": {"samples": 2}}
    assert held.modes == [False, False] and model.training  # eval mode inside, back after
    path = tmp_path / "eval.json"
    assert path.exists() is written
    if written:
        assert json.loads(path.read_text()) == {"step": 10, "eval": results}


def test_a_model_evaluated_in_eval_mode_stays_in_eval_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    held = _Scoring.__new__(_Scoring)
    held.__dict__.update(vars(_held(run_dir=tmp_path)))
    held.modes, held.sets = [], {"captions": ([_mb("a")], 1)}
    model = nn.Linear(2, 2).eval()
    held.evaluate(model, 1)
    assert not model.training



def test_a_run_of_more_than_256_steps_writes_its_last_steps_results(tmp_path, monkeypatch):
    # step counts past CPython's small-int cache: the last step is told by value
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    held = _Scoring.__new__(_Scoring)
    steps = int("1000")  # as a config file gives it: not the literal below's object
    held.__dict__.update(vars(_held(_cfg(steps=steps), run_dir=tmp_path)))
    held.modes, held.sets = [], {"captions": ([_mb("a")], 1)}
    held.evaluate(nn.Linear(2, 2), 1000)
    assert json.loads((tmp_path / "eval.json").read_text())["step"] == 1000
    assert held.due(1000) and not held.due(999)


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_alone_reads_the_held_out_set_and_every_rank_gets_it(tmp_path, monkeypatch,
                                                                    rank):
    from omniscale.tools.train import evaluate

    read = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(evaluate, "scored_sources", lambda cfg, spec: ["captions", "chat"])
    monkeypatch.setattr(evaluate, "_batches",
                        lambda cfg, spec, source, out: read.append((source, out)) or [source])
    sent = {"captions": ["from rank 0"]}
    # the broadcast: rank 0's sets go out as they are; another rank's None is replaced
    monkeypatch.setattr(collectives, "broadcast_held_out",
                        lambda sets: sets if rank == 0 else sent)
    (tmp_path / "eval").mkdir()  # a resumed run: its eval planes' folder is there already
    held = _held(run_dir=tmp_path)
    got = held._read()
    if rank == 0:
        assert read == [("captions", tmp_path / "eval"), ("chat", tmp_path / "eval")]
        assert got == {"captions": ["captions"], "chat": ["chat"]}
    else:
        assert read == [] and got == sent


@pytest.mark.parametrize("precision, device, bf16", [
    ("bf16", "cpu", True), ("fp32", "cuda", False), ("auto", "cuda", True),
    ("auto", "cpu", False), ("bf16", "cuda", True)])
def test_auto_precision_is_bf16_on_cuda_only(monkeypatch, precision, device, bf16):
    """The choice alone (a CUDA autocast cannot be entered here): what ``_precision`` asks
    ``torch.autocast`` for, for a model on each device. The precision string is built at run
    time, as a config file's is."""
    asked = []
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype, enabled: asked.append(
        (device_type, dtype, enabled)))
    on_device = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(
        device=torch.device(device))]))
    HeldOut._precision(_held(_cfg(precision="".join(precision))), on_device)
    assert asked == [(device, torch.bfloat16, bf16)]


class _Sharded(nn.Module):
    """An FSDP root as ``velocity`` sees it (the test makes it the ``FSDPModule`` class):
    records when it is unsharded."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.calls = []

    def unshard(self, async_op=False):
        self.calls.append("unshard")

    def reshard(self):
        self.calls.append("reshard")


@pytest.mark.parametrize("sharded", [True, False])
def test_video_gen_scores_with_the_roots_parameters_gathered_and_each_batchs_own_noise(
        monkeypatch, sharded):
    import torch.distributed.fsdp

    from omniscale.tools.train import video_gen

    monkeypatch.setattr(torch.distributed.fsdp, "FSDPModule", _Sharded)
    model = _Sharded() if sharded else nn.Linear(2, 2)
    seen = []

    def velocity_sums(m, batches, indices):
        seen.append((list(getattr(m, "calls", [])), batches, indices))
        return [1.0, 3.0, 5.0], 4  # per flow time (0.25, 0.5, 0.75), summed errors; patches

    monkeypatch.setattr(video_gen, "velocity_sums", velocity_sums)
    # the peer's sums and patches, as the all-reduce adds them
    monkeypatch.setattr(collectives, "sum_held_out_velocity",
                        lambda both, group: both + torch.tensor([2.0, 1.0, 0.0, 4.0],
                                                                dtype=torch.float64))
    held = _held(rank=1, world=2)
    mine = [(1, "mb1"), (3, "mb3"), (None, "pad")]
    result = held.velocity(model, mine, samples=7)
    calls, batches, indices = seen[0]
    # each real batch draws its noise by its index in the whole set (as one process does);
    # the padding's forward scores nothing, whatever noise it draws
    assert batches == ["mb1", "mb3", "pad"] and indices[:2] == [1, 3] and len(indices) == 3
    if sharded:
        assert calls == ["unshard"] and model.calls == ["unshard", "reshard"]
    # both ranks: sums 3, 4 and 5 over 8 patches at each time -> 12 over 24 targets
    assert result == {"samples": 7, "loss": 0.5, "loss_sum": 12.0, "n_targets": 24.0,
                      "loss_t0.25": 3 / 8, "loss_t0.5": 0.5, "loss_t0.75": 5 / 8}
