"""Training: the schedule, the checkpoint (a resumed run equals an uninterrupted one) and the
step timing."""

import dataclasses
import importlib
import math

import pytest
import torch

from flash_msa.niah.model import VARIANTS, ModelConfig, NeedleLM, init_parameters
from flash_msa.niah.tasks import NeedleConfig
from flash_msa.niah.train import (
    TrainConfig,
    TrainState,
    checkpoint_settings,
    load_checkpoint,
    measure_step_ms,
    save_checkpoint,
    schedule_flops,
    step_flops,
    train,
)

NEEDLES = NeedleConfig()
MODEL = ModelConfig(vocab_size=NEEDLES.vocab_size, layers=2, dim=32, heads=2, kv_heads=1)
SCHEDULE = TrainConfig(steps=3, train_len=256, min_len=128, lr_warmup=1, checkpoint_every=100)
CPU = torch.device("cpu")
TRAIN = importlib.import_module("flash_msa.niah.train")  # flash_msa.niah.train is the function


def fresh(variant: str = "dense") -> NeedleLM:
    model = NeedleLM(variant, MODEL)
    init_parameters(model, SCHEDULE.seed)
    return model


def test_schedule_lengths_curriculum_and_learning_rate():
    config = TrainConfig(steps=1000, train_len=32768, min_len=512, lr_warmup=100)
    assert config.lengths() == [512, 1024, 2048, 4096, 8192, 16384, 32768]
    lengths = [config.length_at(step) for step in range(1000)]
    assert lengths == [config.length_at(step) for step in range(1000)]  # a function of the step
    assert set(lengths[:50]) == {512}  # the curriculum starts short ...
    assert max(lengths[:200]) < 32768 and set(lengths[400:]) == set(config.lengths())  # ... grows
    assert config.batch_size_at(512) == 64 and config.batch_size_at(32768) == 1
    assert config.batch_size_at(32) == config.max_sequences == 128  # not 1024
    assert config.lr_at(0) == pytest.approx(1e-5) and config.lr_at(99) == pytest.approx(1e-3)
    assert config.lr_at(999) == pytest.approx(1e-4, rel=1e-3)  # cosine down to a tenth
    assert config.dense_warmup_at(499, "msa") and not config.dense_warmup_at(500, "msa")
    assert not config.dense_warmup_at(0, "dense")


def test_flop_model():
    tokens = 16384
    dense = step_flops(MODEL, "dense", 16384, tokens)
    assert dense > step_flops(MODEL, "window", 16384, tokens) > 0
    assert step_flops(MODEL, "dense", 128, tokens) == step_flops(MODEL, "window", 128, tokens)
    total = schedule_flops(MODEL, "dense", SCHEDULE, 0)
    assert total == pytest.approx(
        sum(step_flops(MODEL, "dense", SCHEDULE.length_at(s), 256) for s in range(3))
    )
    capped = dataclasses.replace(SCHEDULE, max_sequences=1)  # one sequence per step
    lengths = [capped.length_at(step) for step in range(3)]
    assert 128 in lengths  # a step of fewer tokens than 256
    assert schedule_flops(MODEL, "dense", capped, 0) == pytest.approx(
        sum(step_flops(MODEL, "dense", length, length) for length in lengths)
    )


def test_resumed_training_equals_an_uninterrupted_run(tmp_path):
    straight = fresh()
    state = train(straight, NEEDLES, SCHEDULE, device=CPU, checkpoint_path=tmp_path / "a.pt",
                  progress=False)  # fmt: skip
    assert state.step == 3 and len(state.history) == 3 and state.tokens == 3 * 256
    path = tmp_path / "b.pt"
    for step in (1, 2, 3):  # a deadline already passed: one step per call
        resumed = fresh()  # a new process would start from a fresh model as well
        state_b = train(resumed, NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path,
                        deadline=0.0, progress=False)  # fmt: skip
        assert state_b.step == step
    got = resumed.state_dict()
    for name, expected in straight.state_dict().items():
        assert torch.equal(expected, got[name]), name
    assert [h[:3] for h in state_b.history] == [h[:3] for h in state.history]
    assert all(math.isnan(h[3]) for h in state_b.history)  # no KL loss but msa's
    finished = train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path, progress=False)
    assert finished.step == 3 and finished.tokens == state.tokens  # nothing left to train


def test_an_interrupt_saves_the_steps_completed_and_the_run_resumes(tmp_path, monkeypatch):
    straight = fresh()
    state = train(straight, NEEDLES, SCHEDULE, device=CPU, checkpoint_path=tmp_path / "a.pt",
                  progress=False)  # fmt: skip
    path, losses, calls = tmp_path / "b.pt", TRAIN._losses, []

    def interrupted_at_step_2(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the third step's forward
        return losses(*args, **kwargs)

    monkeypatch.setattr(TRAIN, "_losses", interrupted_at_step_2)
    with pytest.raises(KeyboardInterrupt):  # checkpoint_every 100: no checkpoint before it
        train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path, progress=False)
    monkeypatch.undo()
    resumed = fresh()
    state_b = train(resumed, NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path, deadline=0.0,
                    progress=False)  # fmt: skip
    assert state_b.step == 3  # one step (the deadline) from the 2 saved
    assert [h[:3] for h in state_b.history] == [h[:3] for h in state.history]
    got = resumed.state_dict()
    assert all(torch.equal(expected, got[name]) for name, expected in straight.state_dict().items())


def test_an_interrupt_mid_update_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """Between an optimizer step and its count the model is ahead of the state: no save."""

    def interrupted(self, closure=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupted)
    path = tmp_path / "dense.pt"
    with pytest.raises(KeyboardInterrupt):
        train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path, progress=False)
    assert not path.exists()


def test_batches_built_by_worker_processes_train_the_same(tmp_path):
    here = train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=tmp_path / "a.pt",
                 progress=False)  # fmt: skip
    workers = train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=tmp_path / "b.pt",
                    progress=False, data_workers=2)  # fmt: skip
    assert [h[:3] for h in workers.history] == [h[:3] for h in here.history]


def test_a_checkpoint_of_other_settings_is_refused(tmp_path):
    path = tmp_path / "dense.pt"
    train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path, deadline=0.0,
          progress=False)  # fmt: skip
    other = dataclasses.replace(SCHEDULE, lr=2e-3)
    with pytest.raises(ValueError, match=r"train.lr=0.001 \(now 0.002\).*another checkpoint"):
        train(fresh(), NEEDLES, other, device=CPU, checkpoint_path=path, progress=False)
    with pytest.raises(ValueError, match="variant='dense' \\(now 'window'\\)"):
        train(fresh("window"), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path,
              progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"model.dim \(--dim\)=32 \(now 64\)"):
        train(NeedleLM("dense", dataclasses.replace(MODEL, dim=64)), NEEDLES, SCHEDULE,
              device=CPU, checkpoint_path=path, progress=False)  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_checkpoint_written_loads_with_weights_only(variant, tmp_path):
    model = NeedleLM(variant, MODEL)
    optimizer = TRAIN._optimizer(model, SCHEDULE, CPU)
    sum(parameter.sum() for parameter in model.parameters()).backward()
    optimizer.step()  # optimizer state: step counts and moments
    settings = checkpoint_settings(model, NEEDLES, SCHEDULE, CPU)
    state = TrainState(step=1, history=[[0, 128, 5.5, math.nan, 5.6]], train_seconds=0.5,
                       tokens=256)  # fmt: skip
    path = tmp_path / f"{variant}.pt"
    save_checkpoint(path, model, optimizer, state, settings)
    loaded = NeedleLM(variant, MODEL)
    loaded_optimizer = TRAIN._optimizer(loaded, SCHEDULE, CPU)
    got = load_checkpoint(path, loaded, loaded_optimizer, settings)
    assert (got.step, got.tokens, got.history[0][:3]) == (1, 256, [0, 128, 5.5])
    assert math.isnan(got.history[0][3])
    for name, expected in model.state_dict().items():
        assert torch.equal(expected, loaded.state_dict()[name]), name
    moments = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    loaded_moments = [loaded_optimizer.state[p]["exp_avg"] for p in loaded.parameters()]
    assert all(map(torch.equal, moments, loaded_moments))


class RunsCodeWhenLoaded:
    def __reduce__(self):
        return print, ("code ran",)


def test_a_checkpoint_holding_code_is_refused_unrun(tmp_path, capsys):
    path = tmp_path / "dense.pt"
    torch.save(dict(settings=RunsCodeWhenLoaded()), path)
    with pytest.raises(ValueError, match=r"dense.pt is unreadable \(weights_only refused it: "
                       r"Unsupported global: GLOBAL print [^\n]*\): delete it"):  # fmt: skip
        train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path, progress=False)
    assert "code ran" not in capsys.readouterr().out


@pytest.mark.parametrize("content, reason", [("not a checkpoint", "weights_only refused it: "
                                               "Unsupported operand"), ("", "EOFError")])
def test_a_corrupt_checkpoint_is_refused_in_a_line(tmp_path, content, reason):
    path = tmp_path / "dense.pt"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"dense.pt is unreadable \({reason}[^\n]*\): delete it"):
        train(fresh(), NEEDLES, SCHEDULE, device=CPU, checkpoint_path=path, progress=False)


def test_step_timing_changes_no_parameter():
    model = fresh()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert measure_step_ms(model, NEEDLES, SCHEDULE, 256, device=CPU, repeats=2) > 0
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(train_len=384), r"min_len 128 \(the shortest .*\) times a power of two, e.g. 256 or"),
        (dict(steps=0), r"steps \(--steps\) must be a positive int"),
        (dict(curriculum=1.5), "curriculum must be a fraction"),
        (dict(batch=4, max_sequences=2), r"batch \(--batch\) 4 .* more than max_sequences 2"),
        (dict(curriculum=None), "curriculum must be a fraction"),
        (dict(lr=-1.0), "lr must be a positive finite number"),
        (dict(lr=float("nan")), "lr must be a positive finite number"),
        (dict(grad_clip=0), "grad_clip must be a positive finite number"),
        (dict(kl_weight="a"), "kl_weight must be a finite number >= 0"),
        (dict(lr_warmup=1.5), "lr_warmup must be an int >= 0"),
        (dict(seed=None), r"seed \(--seed\) must be an int >= 0"),
    ],
)
def test_config_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SCHEDULE, **changes)


def test_too_short_a_training_length_is_refused(tmp_path):
    config = TrainConfig(steps=1, train_len=32, min_len=16)
    with pytest.raises(ValueError, match=r"min_len 16 \(.*\) cannot hold the training samples"):
        train(fresh(), NEEDLES, config, device=CPU, checkpoint_path=tmp_path / "x.pt")
