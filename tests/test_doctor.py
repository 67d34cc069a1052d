"""course_lib.chapters.ch05.doctor: each classic mistake is named by a broken loop that makes it, and the
correct loops of chapters 03-05 (and the course's own Trainer) get no false alarm."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.chapters.ch05 import article_two_models, multi
from course_lib.chapters.ch05.doctor import PROBLEMS, diagnose
from course_lib.train import TrainConfig, Trainer

pytestmark = pytest.mark.skipif(not multi.cpu_fp16_scaler_works(), reason="needs CPU fp16 autocast + GradScaler")
ACCUM = 4


def fp16():
    return torch.autocast("cpu", dtype=torch.float16)


def setup(seed: int = 0, init_scale: float = 2.0**8, n: int = 16):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    batches = [(torch.randn(16, 20), torch.randint(0, 4, (16,))) for _ in range(n)]
    return model, opt, scaler, batches


def codes(train, *objects, accum: int = 1, loss_fn=F.cross_entropy) -> list[str]:
    report = diagnose(train, *objects, loss_fn=loss_fn, accum_steps=accum)
    assert all(len(line) <= 100 for line in str(report).splitlines()), str(report)
    return report.codes


# --------------------------------------------------------------------------- correct loops


def typical(model, opt, scaler, batches):  # chapter 03
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def clipped(model, opt, scaler, batches):  # chapter 03: unscale_, then clip
    for x, y in batches:
        opt.zero_grad(set_to_none=False)
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def accumulated(model, opt, scaler, batches, clip=True, zero_first=False):  # chapter 04
    for i, (x, y) in enumerate(batches):
        if zero_first and i % ACCUM == 0:
            opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y) / ACCUM
        scaler.scale(loss).backward()
        if (i + 1) % ACCUM == 0:
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            if not zero_first:
                opt.zero_grad()


def with_trainer(model, opt, scaler, batches):  # the course's one loop (course_lib.train), accumulating
    trainer = Trainer(
        model, opt, TrainConfig(precision="fp16", device="cpu", accum_steps=ACCUM, clip_grad_norm=1.0, progress=False)
    )
    trainer.scaler = scaler
    for i in range(0, len(batches), ACCUM):
        trainer.train_step(batches[i : i + ACCUM])


def two_models(models, opts, scaler, batches):  # chapter 05
    mode = multi.amp_mode("cpu")
    for x, y in batches:
        article_two_models.two_model_step(*models, *opts, scaler, x, y, mode, max_norm=1.0)


def gan(models, opts, scaler, batches):  # chapter 05: alternating updates
    mode = multi.amp_mode("cpu")
    for x, _ in batches:
        multi.gan_step(*models, *opts, scaler, x, torch.randn(len(x), 32), mode)


def penalty(model, opt, scaler, batches):  # chapter 05: gradient penalty
    mode = multi.amp_mode("cpu")
    for x, y in batches:
        opt.zero_grad()
        multi.penalty_backward(model, scaler, x, y, mode)
        scaler.step(opt)
        scaler.update()


def bf16_alone(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward() if scaler is not None else loss.backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()


@pytest.mark.parametrize(
    "train,accum",
    [
        (typical, 1),
        (clipped, 1),
        (accumulated, ACCUM),
        (functools.partial(accumulated, clip=False, zero_first=True), ACCUM),
        (with_trainer, ACCUM),
        (penalty, 1),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_correct_single_model_loops_get_no_false_alarm(train, accum):
    for init_scale in (2.0**8, 2.0**16):  # 2^16 overflows at first: skipped steps are no mistake
        assert codes(train, *setup(init_scale=init_scale), accum=accum) == []


def test_the_gradient_check_runs_and_agrees_on_a_correct_accumulation():
    report = diagnose(accumulated, *setup(), loss_fn=F.cross_entropy, accum_steps=ACCUM)
    note = " ".join(report.notes)
    assert "4 optimizer steps compared" in note and report.codes == []


def test_correct_multi_model_loops_get_no_false_alarm():
    m0, m1 = article_two_models.two_models(0)
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.01) for m in (m0, m1))
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(6)]
    assert codes(two_models, (m0, m1), opts, torch.amp.GradScaler("cpu"), batches, loss_fn=None) == []
    gen, disc = multi.Generator(), multi.Discriminator()
    opts = tuple(torch.optim.Adam(m.parameters(), lr=2e-4) for m in (gen, disc))
    images = [(torch.rand(8, 1, 28, 28) * 2 - 1, None) for _ in range(6)]
    assert codes(gan, (gen, disc), opts, torch.amp.GradScaler("cpu"), images, loss_fn=None) == []


def test_bf16_without_a_scaler_or_with_a_disabled_one_gets_no_false_alarm():
    model, opt, _, batches = setup()
    assert codes(bf16_alone, model, opt, None, batches) == []
    assert codes(bf16_alone, model, opt, torch.amp.GradScaler("cpu", enabled=False), batches) == []


def test_the_doctor_leaves_the_callers_objects_and_rng_alone():
    model, opt, scaler, batches = setup()
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    diagnose(accumulated, model, opt, scaler, batches, loss_fn=F.cross_entropy, accum_steps=ACCUM)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state()) and opt.state == {} and scaler.get_scale() == 2.0**8
    assert (
        torch.autograd.backward.__module__ == "torch.autograd"
        and nn.utils.clip_grad_norm_.__name__ == "clip_grad_norm_"
        and "wrapper" not in repr(F.binary_cross_entropy)
    )


# --------------------------------------------------------------------------- broken loops, one mistake each


def backward_inside(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def one_region(model, opt, scaler, batches):
    with fp16():
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def update_every_micro_batch(model, opt, scaler, batches):  # with unscale_ (for clipping) on every micro-batch
    for i, (x, y) in enumerate(batches):
        with fp16():
            loss = F.cross_entropy(model(x), y) / ACCUM
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if (i + 1) % ACCUM == 0:
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()


def step_every_micro_batch(model, opt, scaler, batches):
    for i, (x, y) in enumerate(batches):
        with fp16():
            loss = F.cross_entropy(model(x), y) / ACCUM
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if (i + 1) % ACCUM == 0:
            opt.zero_grad()


def clip_first(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        clip_grad_norm_(model.parameters(), 1.0)  # noqa: F821 -- bound in the test, as `from ... import` would
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()


def bce_loop(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            prob = torch.sigmoid(model(x)[:, 0])
            loss = nn.BCELoss()(prob, (y > 1).float())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def no_zero_grad(model, opt, scaler, batches):
    for i, (x, y) in enumerate(batches):
        with fp16():
            loss = F.cross_entropy(model(x), y) / ACCUM
        scaler.scale(loss).backward()
        if (i + 1) % ACCUM == 0:
            scaler.step(opt)
            scaler.update()


def zero_every_micro_batch(model, opt, scaler, batches):
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y) / ACCUM
        scaler.scale(loss).backward()
        if (i + 1) % ACCUM == 0:
            scaler.step(opt)
            scaler.update()


def divided_by(model, opt, scaler, batches, by=2):  # accumulates ACCUM micro-batches, divides by `by`
    for i, (x, y) in enumerate(batches):
        with fp16():
            loss = F.cross_entropy(model(x), y) / by
        scaler.scale(loss).backward()
        if (i + 1) % ACCUM == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


def not_divided(model, opt, scaler, batches):
    divided_by(model, opt, scaler, batches, by=1)


def unscaled_backward(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        scaler.step(opt)
        scaler.update()


def direct_step(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.step()


def no_autocast(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()


def zero_before_step(model, opt, scaler, batches):
    for x, y in batches:
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.zero_grad(set_to_none=False)
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize(
    "train,accum,expected",
    [
        (backward_inside, 1, "backward_in_autocast"),
        (one_region, 1, "step_in_autocast"),
        (update_every_micro_batch, ACCUM, "update_per_microstep"),
        (step_every_micro_batch, ACCUM, "step_per_microstep"),
        (bce_loop, 1, "bce_in_autocast"),
        (no_zero_grad, ACCUM, "missing_zero_grad"),
        (zero_every_micro_batch, ACCUM, "zero_grad_in_window"),
        (not_divided, ACCUM, "loss_not_divided"),
        (unscaled_backward, 1, "not_scaled"),
        (direct_step, 1, "step_without_scaler"),
        (no_autocast, 1, "no_autocast"),
        (zero_before_step, 1, "empty_step"),
    ],
    ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", ""),
)
def test_each_mistake_is_named(train, accum, expected):
    found = codes(train, *setup(), accum=accum)
    assert expected in found, found
    assert "raised" not in found or expected in ("update_per_microstep", "not_scaled"), found


def test_clipping_before_unscale_is_seen_even_through_an_imported_name():
    clip_first.__globals__["clip_grad_norm_"] = nn.utils.clip_grad_norm_  # `from torch.nn.utils import ...`
    try:
        assert codes(clip_first, *setup()) == ["clip_before_unscale"]
    finally:
        del clip_first.__globals__["clip_grad_norm_"]


def test_fp16_parameters_are_named_with_the_error_they_cause():
    model, opt, scaler, batches = setup()
    model.half()
    report = diagnose(typical, model, opt, scaler, batches)
    assert report.codes[0] == "fp16_params" and report.codes[-1] == "raised"
    assert "FP16 gradients" in report.findings[-1].seen and "fp32" in report.findings[-1].fix


def test_update_between_the_optimizers_steps_is_named():
    def update_between(models, opts, scaler, batches):
        for x, y in batches:
            for o in opts:
                o.zero_grad()
            with fp16():
                out0, out1 = models[0](x), models[1](x)
                loss0, loss1 = F.mse_loss(2 * out0 + 3 * out1, y), F.mse_loss(3 * out0 - 5 * out1, y)
            scaler.scale(loss0).backward(retain_graph=True)
            scaler.scale(loss1).backward()
            scaler.step(opts[0])
            scaler.update()
            scaler.step(opts[1])
            scaler.update()

    m0, m1 = article_two_models.two_models(0)
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.01) for m in (m0, m1))
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(4)]
    assert codes(update_between, (m0, m1), opts, torch.amp.GradScaler("cpu"), batches, loss_fn=None) == [
        "update_between_steps"
    ]


def test_a_missing_retain_graph_is_explained():
    def no_retain(models, opts, scaler, batches):
        for x, y in batches:
            with fp16():
                out0, out1 = models[0](x), models[1](x)
                loss0, loss1 = F.mse_loss(2 * out0 + 3 * out1, y), F.mse_loss(3 * out0 - 5 * out1, y)
            scaler.scale(loss0).backward()
            scaler.scale(loss1).backward()

    m0, m1 = article_two_models.two_models(0)
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.01) for m in (m0, m1))
    report = diagnose(no_retain, (m0, m1), opts, torch.amp.GradScaler("cpu"), [(torch.randn(8, 16), torch.randn(8, 4))])
    assert report.codes == ["raised"] and "retain_graph=True" in report.findings[0].fix


def test_every_problem_has_a_title_and_a_fix():
    for code, (title, fix, chapter) in PROBLEMS.items():
        assert title and (fix and chapter or code == "raised")


def test_chapter_04s_accumulation_step_gets_no_false_alarm():
    accumulation = pytest.importorskip("course_lib.chapters.ch04.accumulation")
    step = getattr(accumulation, "accumulation_step", None)
    if step is None:
        pytest.skip("chapter 04 has no accumulation_step")

    def loop(model, opt, scaler, batches):
        for i in range(0, len(batches), ACCUM):
            step(model, opt, scaler, batches[i : i + ACCUM], dtype=torch.float16, clip_grad_norm=1.0)

    model, opt, scaler, batches = setup()
    batches[-1] = (batches[-1][0][:5], batches[-1][1][:5])  # a short last micro-batch, weighted by its size
    report = diagnose(loop, model, opt, scaler, batches, loss_fn=F.cross_entropy, accum_steps=ACCUM)
    assert report.codes == [] and "4 optimizer steps compared" in report.notes[0], str(report)


# --------------------------------------------------------------------------- chapter 09's additions


def scheduled(model, opt, scaler, batches, every_step=False):  # chapter 03: the scheduler and skipped steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10))
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        before = scaler.get_scale()
        scaler.update()
        if every_step or scaler.get_scale() >= before:  # the scale falls exactly when the step was skipped
            sched.step()


def checkpointing(model, opt, scaler, batches, with_scaler=True):  # chapter 03: the scaler is training state
    import io

    typical(model, opt, scaler, batches)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save({**state, "scaler": scaler.state_dict()} if with_scaler else state, io.BytesIO())


def overflowing_forward(model, opt, scaler, batches):  # the forward leaves fp16's range
    typical(model, opt, scaler, [(x * 1e6, y) for x, y in batches])


def gradient_always_inf(model, opt, scaler, batches):  # finite loss, inf gradient at any scale
    model[0].weight.register_hook(lambda g: g * float("inf"))
    typical(model, opt, scaler, batches)


def old_spelling(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with torch.cpu.amp.autocast(dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


class MatMul(torch.autograd.Function):  # a custom op without custom_fwd / custom_bwd
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def custom_function(model, opt, scaler, batches):
    w = torch.nn.Parameter(torch.randn(4, 4) * 0.1)
    opt.add_param_group({"params": [w]})
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(MatMul.apply(model(x), w), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_the_chapter_09_loops_done_right_get_no_false_alarm():
    for init_scale in (2.0**8, 2.0**24):  # 2^24 skips its first steps: the scheduler waits for them
        assert codes(scheduled, *setup(init_scale=init_scale)) == []
    assert codes(checkpointing, *setup()) == []
    model, opt, _, batches = setup()
    assert codes(checkpointing, model, opt, torch.amp.GradScaler("cpu", enabled=False), batches) == []


@pytest.mark.parametrize(
    "train,expected,init_scale",
    [
        (functools.partial(scheduled, every_step=True), ["scheduler_on_skipped_step"], 2.0**24),
        (functools.partial(checkpointing, with_scaler=False), ["checkpoint_without_scaler"], 2.0**8),
        (overflowing_forward, ["nonfinite_loss", "scale_collapsing"], 2.0**8),
        (gradient_always_inf, ["scale_collapsing"], 2.0**8),
        (old_spelling, ["deprecated_amp_api"], 2.0**8),
    ],
    ids=lambda v: getattr(v, "__name__", getattr(getattr(v, "func", None), "__name__", "")),
)
def test_each_chapter_09_mistake_is_named(train, expected, init_scale):
    assert codes(train, *setup(init_scale=init_scale)) == expected


def test_a_scaler_beside_bf16_and_a_deprecated_scaler_are_named():
    model, opt, scaler, batches = setup()
    assert codes(bf16_alone, model, opt, scaler, batches) == ["scaler_with_bf16"]
    with pytest.warns(FutureWarning):
        old = torch.cuda.amp.GradScaler(enabled=False)
    assert codes(bf16_alone, model, opt, old, batches) == ["deprecated_amp_api"]


def test_a_custom_function_without_custom_fwd_is_explained():
    report = diagnose(custom_function, *setup())
    assert report.codes == ["raised"] and "custom_fwd" in report.findings[0].fix, str(report)


# --------------------------------------------------------------------------- the AMP examples page
# https://docs.pytorch.org/docs/stable/notes/amp_examples.html: each pattern as the page writes it (fp16 autocast
# on the CPU); the typical loop, clipping and accumulation are `typical`, `clipped` and `accumulated` above.


def page_penalty(model, opt, scaler, batches, scale_loss=True, unscale=True, divide=False):  # "Gradient penalty"
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        outputs = scaler.scale(loss) if scale_loss else loss  # the page: scaler.scale(loss)
        grads = torch.autograd.grad(outputs=outputs, inputs=model.parameters(), create_graph=True)
        if unscale and scale_loss:
            inv_scale = 1.0 / scaler.get_scale()  # the gradients belong to no optimizer: unscale by hand
            grads = [p / scaler.get_scale() for p in grads] if divide else [p * inv_scale for p in grads]
        with fp16():
            grad_norm = 0
            for g in grads:
                grad_norm += g.pow(2).sum()
            loss = loss + grad_norm.sqrt()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def page_two_models(models, opts, scaler, batches):  # "Working with Multiple Models, Losses, and Optimizers"
    (model0, model1), (optimizer0, optimizer1) = models, opts
    for x, y in batches:
        optimizer0.zero_grad()
        optimizer1.zero_grad()
        with fp16():
            output0, output1 = model0(x), model1(x)
            loss0 = F.mse_loss(2 * output0 + 3 * output1, y)
            loss1 = F.mse_loss(3 * output0 - 5 * output1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(optimizer0)  # the page: choose which optimizers receive explicit unscaling
        scaler.step(optimizer0)
        scaler.step(optimizer1)
        scaler.update()


class PageMM(torch.autograd.Function):  # "Autocast and Custom Autograd Functions": custom_fwd / custom_bwd
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class PageFloat32Func(torch.autograd.Function):  # the page's cast_inputs=torch.float32 variant
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        assert x.dtype == torch.float32
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


def page_custom_functions(model, opt, scaler, batches):
    w = torch.nn.Parameter(torch.eye(4) + 0.1 * torch.randn(4, 4))
    opt.add_param_group({"params": [w]})
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(PageFloat32Func.apply(PageMM.apply(model(x), w)), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


PAGE_LOOPS = [
    (typical, 1, 6),
    (clipped, 1, 6),
    (functools.partial(accumulated, clip=False), ACCUM, 8),
    (page_penalty, 1, 6),
    (functools.partial(page_penalty, divide=True), 1, 4),
    (page_custom_functions, 1, 6),
]


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**24, 2.0**32])
@pytest.mark.parametrize(
    "train,accum,n", PAGE_LOOPS, ids=lambda v: getattr(v, "__name__", getattr(getattr(v, "func", None), "__name__", ""))
)
def test_every_pattern_of_the_amp_examples_page_gets_no_finding(train, accum, n, init_scale):
    # 2^24 and 2^32 over a few steps: the first steps are skipped while the scale comes down, as GradScaler does
    report = diagnose(train, *setup(init_scale=init_scale, n=n), loss_fn=F.cross_entropy, accum_steps=accum)
    assert report.codes == [], str(report)


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**24])
def test_the_pages_multiple_models_losses_and_optimizers_get_no_finding(init_scale):
    models = article_two_models.two_models(0)
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.01) for m in models)
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(6)]
    assert (
        codes(page_two_models, models, opts, torch.amp.GradScaler("cpu", init_scale=init_scale), batches, loss_fn=None)
        == []
    )


def test_skipped_first_steps_under_a_large_init_scale_are_called_normal_not_a_model_bug():
    report = diagnose(typical, *setup(init_scale=2.0**24, n=6))
    assert report.codes == [] and "normal" in " ".join(report.notes), str(report)
    assert "(6 skipped by the scaler)" in report.summary  # all of them: the scale is still coming down


# --------------------------------------------------------------------------- the review's misses and wrong advice


@pytest.mark.parametrize("by", [1, 2, 8])
def test_a_loss_divided_by_the_wrong_count_is_named_with_the_fix(by):
    report = diagnose(functools.partial(divided_by, by=by), *setup(), loss_fn=F.cross_entropy, accum_steps=ACCUM)
    assert report.codes == ["loss_not_divided"], str(report)
    finding = report.findings[0]
    assert f"{ACCUM / by:.2f} times" in finding.seen and "number of micro-batches" in finding.fix


def scheduler_first(model, opt, scaler, batches):  # scheduler.step() before the optimizer's step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10))
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        sched.step()
        scaler.step(opt)
        scaler.update()


def test_a_per_epoch_scheduler_after_an_evaluation_forward_gets_no_finding():
    def loop(model, opt, scaler, batches):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        for epoch in range(2):
            typical(model, opt, scaler, batches[epoch::2])
            with torch.no_grad():
                model(batches[0][0])  # evaluation between the epoch's last step and the scheduler
            sched.step()

    assert codes(loop, *setup()) == []


def test_a_scheduler_stepped_before_the_optimizer_is_named():
    report = diagnose(scheduler_first, *setup())
    assert report.codes == ["scheduler_before_step"], str(report)
    assert "after scaler.step" in report.findings[0].fix and "skipped" in report.findings[0].fix
    # with skipped steps, the schedule also advanced on them: both are said
    assert codes(scheduler_first, *setup(init_scale=2.0**24)) == ["scheduler_before_step", "scheduler_on_skipped_step"]


def test_the_gradient_penalty_from_still_scaled_gradients_is_named():
    report = diagnose(functools.partial(page_penalty, unscale=False), *setup())
    assert report.codes == ["penalty_from_scaled_grads"], str(report)
    assert "get_scale()" in report.findings[0].fix


def test_the_gradient_penalty_from_the_unscaled_loss_is_named():
    report = diagnose(functools.partial(page_penalty, scale_loss=False), *setup())
    assert report.codes == ["penalty_from_unscaled_loss"], str(report)
    assert "scaler.scale(loss)" in report.findings[0].fix and "underflow" in report.findings[0].fix


def no_update(model, opt, scaler, batches, clip=False):
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)


@pytest.mark.parametrize("clip", [False, True])
def test_a_loop_without_update_is_told_update_is_missing(clip):
    report = diagnose(functools.partial(no_update, clip=clip), *setup())
    assert report.codes == ["missing_update", "raised"], str(report)
    assert "twice" not in str(report) and "scaler.update()" in report.findings[0].fix


def test_a_single_iteration_without_update_is_told_update_is_missing():
    assert codes(no_update, *setup(n=1)) == ["missing_update"]


def unscale_after_step(model, opt, scaler, batches):
    for x, y in batches:
        opt.zero_grad()
        with fp16():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.update()


def test_unscale_after_step_is_told_the_order_not_a_missing_update():
    report = diagnose(unscale_after_step, *setup())
    assert report.codes == ["unscale_after_step", "raised"], str(report)
    assert "before scaler.step" in report.findings[0].fix and "missing" not in str(report)


def test_a_direct_step_with_scaled_gradients_is_not_blamed_on_a_forward_overflow():
    # exercise 05's fix-one-at-a-time workflow: the broken loop with retain_graph=True added. opt1.step() applies
    # gradients still multiplied by 2^10, the weights blow up and later losses are inf: the cause is the step.
    def loop(models, opts, scaler, batches):
        (model0, model1), (opt0, opt1) = models, opts
        for x, y in batches:
            opt0.zero_grad()
            with fp16():
                out0, out1 = model0(x), model1(x)
                loss0, loss1 = F.mse_loss(2 * out0 + 3 * out1, y), F.mse_loss(3 * out0 - 5 * out1, y)
            scaler.scale(loss0).backward(retain_graph=True)
            opt1.zero_grad()
            scaler.scale(loss1).backward()
            nn.utils.clip_grad_norm_(model0.parameters(), 0.1)
            scaler.unscale_(opt0)
            scaler.step(opt0)
            scaler.update()
            opt1.step()

    models = article_two_models.two_models(seed=0)
    opts = tuple(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)) for _ in range(4)]
    report = diagnose(loop, models, opts, torch.amp.GradScaler("cpu", init_scale=2.0**10), batches)
    assert report.codes == ["step_without_scaler", "clip_before_unscale"], str(report)
    assert "inf/NaN" in report.findings[0].seen  # the consequence is said where the cause is
