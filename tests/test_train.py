"""course_lib.train: one loop, three precisions; each test breaks if the loop's rules break."""

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from course_lib.loaders import make_loader
from course_lib.models import MLP
from course_lib.train import TrainConfig, Trainer


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


def make(precision="fp32", seed=0, lr=0.05, scheduler=False, **cfg):
    torch.manual_seed(seed)
    model = MLP(in_features=64, hidden=32)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    cfg = TrainConfig(precision=precision, device="cpu", progress=False, **{"log_every": 1, **cfg})
    return Trainer(model, opt, cfg, scheduler=sched)


def force_inf_at(trainer, steps):
    """Make the gradient of one weight inf on the given (1-based) optimizer steps."""
    w = trainer.model.net[1].weight
    w.register_hook(lambda g: g + math.inf if trainer.step_count + 1 in steps else g)


def test_fp16_on_cpu_records_skipped_steps_and_backs_off_the_scale():
    t = make("fp16", init_scale=1024.0)
    force_inf_at(t, {3})
    b1, b2, b3, b4, b5 = (data(16, s)[:] for s in range(5))
    t.train_step([b1])
    t.train_step([b2])
    before = [p.detach().clone() for p in t.model.parameters()]
    assert t.train_step([b3]), "step 3's gradient is inf: the step must be skipped"
    after = list(t.model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(before, after)), "a skipped step must not change weights"
    t.train_step([b4])
    t.train_step([b5])
    assert t.history.skipped == [False, False, True, False, False]
    assert t.history.scale[2] == t.history.scale[1] * 0.5


def test_skipped_steps_do_not_advance_the_lr_scheduler():
    t = make("fp16", scheduler=True, init_scale=1024.0)
    force_inf_at(t, {2, 4})
    for s in range(6):
        t.train_step([data(16, s)[:]])
    assert t.history.skipped_steps == 2
    assert t.scheduler.last_epoch == 4  # six steps, two skipped
    assert t.history.lr == [0.05, 0.025, 0.025, 0.0125, 0.0125, 0.00625]


def test_bf16_and_fp32_never_skip_and_keep_fp32_parameters():
    for precision in ("fp32", "bf16"):
        t = make(precision)
        for s in range(3):
            t.train_step([data(16, s)[:]])
        assert t.history.skipped == [False] * 3 and t.history.scale == [1.0] * 3
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in t.model.parameters())
        with t.autocast():
            out = t.model(data(4)[:][0])
        assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)


def test_accumulating_four_micro_batches_equals_one_four_times_larger_batch():
    x, y = data(64)[:]
    big, acc = make("fp32"), make("fp32", accum_steps=4)
    big.train_step([(x, y)])
    acc.train_step([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)])
    for p, q in zip(big.model.parameters(), acc.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert big.history.loss[0] == pytest.approx(acc.history.loss[0], rel=1e-5)


def test_clipping_sees_unscaled_gradients_under_fp16():
    ref, amp = make("fp32", clip_grad_norm=1e9), make("fp16", clip_grad_norm=1e9)
    batch = data(32)[:]
    ref.train_step([batch])
    amp.train_step([batch])
    # If clip_grad_norm_ ran before unscale_, the fp16 norm would be ~65536x larger.
    assert amp.history.grad_norm[0] == pytest.approx(ref.history.grad_norm[0], rel=0.05)


def test_clipping_bounds_the_update():
    t = make("fp32", clip_grad_norm=0.01, lr=1.0)
    p0 = [p.detach().clone() for p in t.model.parameters()]
    t.cfg.clip_grad_norm, t.optimizer.param_groups[0]["momentum"] = 0.01, 0.0
    t.train_step([data(32)[:]])
    moved = torch.sqrt(sum(((p - q) ** 2).sum() for p, q in zip(t.model.parameters(), p0)))
    assert moved.item() == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_resume_from_checkpoint_continues_bit_identically(tmp_path, precision):
    ds = data(96)
    straight = make(precision, epochs=2, accum_steps=2, growth_interval=3)
    straight.fit(make_loader(ds, 16, seed=1))

    first = make(precision, epochs=2, accum_steps=2, growth_interval=3, max_steps=4)
    first.fit(make_loader(ds, 16, seed=1))  # stops mid-epoch 1 (3 steps per epoch)
    first.save_checkpoint(tmp_path / "ckpt.pt")
    second = make(precision, seed=123, epochs=2, accum_steps=2, growth_interval=3)  # different init
    second.load_checkpoint(tmp_path / "ckpt.pt")
    second.fit(make_loader(ds, 16, seed=1))

    assert second.step_count == straight.step_count == 6
    for p, q in zip(straight.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)
    assert second.history.loss == straight.history.loss
    assert second.history.scale == straight.history.scale
    if precision == "fp16":
        assert straight.scaler.state_dict() == second.scaler.state_dict()
        assert straight.history.scale[-1] > 2.0**16  # grew after 3 clean steps: scaler state was resumed


def test_fit_returns_history_with_eval_and_checkpoint(tmp_path):
    ds = data(64)
    cfg = TrainConfig(
        precision="fp32", device="cpu", epochs=2, progress=False, checkpoint_path=str(tmp_path / "run.pt")
    )
    torch.manual_seed(0)
    model = MLP(in_features=64, hidden=32)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    hist = trainer.fit(make_loader(ds, 16), make_loader(ds, 32, shuffle=False))
    assert len(hist.step) == len(hist.loss) == 8
    assert [e["epoch"] for e in hist.eval] == [0, 1] and 0.0 <= hist.eval[-1]["accuracy"] <= 1.0
    assert (tmp_path / "run.pt").exists() and not (tmp_path / "run.pt.tmp").exists()
    assert "fp32 on cpu: 8 steps" in hist.summary() and len(hist.summary()) <= 100  # one notebook line


def test_a_step_budget_that_ends_the_run_mid_epoch_still_evaluates():
    # chapter 00 trains for max_steps < one epoch and prints the accuracy: it must exist
    ds = data(64)
    cfg = TrainConfig(precision="fp32", device="cpu", epochs=1, max_steps=3, progress=False)
    torch.manual_seed(0)
    model = MLP(in_features=64, hidden=32)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    hist = trainer.fit(make_loader(ds, 16), make_loader(ds, 32, shuffle=False))
    assert len(hist.step) == 3
    assert [(e["epoch"], e["step"]) for e in hist.eval] == [(0, 3)]
    assert "eval accuracy" in hist.summary()
    assert trainer.batch_in_epoch == 3  # still mid-epoch: a resumed fit goes on from micro-batch 3


def test_auto_precision_is_the_device_policy():
    from course_lib.device import recommend_precision

    assert make("auto").precision == recommend_precision("cpu").precision


def test_an_fp16_step_reads_nothing_back_from_the_device_until_the_history_is_read(monkeypatch):
    # get_scale() copies the scale to the host: on a GPU a sync per call, which chapter 06 teaches to
    # avoid. The Trainer compares scales on the device and reads them back with the losses.
    t = make("fp16", init_scale=1024.0, log_every=100)
    force_inf_at(t, {2})
    calls = []
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: calls.append(1) or 1.0)
    batches = [data(16, s)[:] for s in range(3)]
    results = [t.train_step([(x, y)]) for x, y in batches]
    assert calls == [] and all(isinstance(r, torch.Tensor) for r in results)
    assert len(t._history.scale) == 0  # still on the device ...
    assert t.history.skipped == [False, True, False] and [bool(r) for r in results] == [False, True, False]
    assert t.history.scale == [1024.0, 512.0, 512.0]  # ... until the history is read


def test_every_training_step_of_the_course_is_the_one_amp_step(monkeypatch):
    # The course has one training step, train.amp_step: the Trainer, chapter 04's accumulation, the
    # DDP worker's timed step, the GPT ladder and the speed-up script must all run it, not a copy.
    from course_lib import train
    from course_lib.chapters.ch04 import accumulation
    from course_lib.chapters.ch08 import ddp_worker
    from course_lib.chapters.ch09 import ladder, speedup
    from course_lib.models import GPT, GPTConfig

    calls, real = [], train.amp_step

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in (train, accumulation, ddp_worker, ladder, speedup):
        monkeypatch.setattr(module, "amp_step", spy)
    t = make("bf16")
    t.train_step([data(8, 0)[:]])
    x, y = data(8, 1)[:]
    accumulation.accumulation_step(t.model, t.optimizer, t.scaler, [(x, y)], dtype=torch.bfloat16)
    ddp_worker._bench_step(t.model, t.optimizer, t.scaler, x, y, None)
    gpt = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=1, n_embd=8))
    tokens = torch.randint(0, 32, (2, 8))
    ladder._gpt_step(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), tokens, tokens, "bf16", t.scaler)()
    assert len(calls) == 4
    speedup.run_script(
        {"train_size": 64, "test_size": 16, "max_steps": 2, "batch_size": 32, "precision": "fp32"}, device="cpu"
    )
    assert len(calls) == 6
