"""Records GPT-2 small trained in bf16 against torchao's float8 recipes (tensorwise, rowwise), compiled.

    python -m course_lib.chapters.ch11.record_fp8 --json data/reference/fp8gpt_<gpu>.json

Every recipe trains the same model on the same synthetic language (`markov_batches`) with the core's
`amp_step` under bf16 autocast; torchao's `convert_to_float8_training` swaps every Linear but the
output layer for one whose matmuls run in fp8. Rows: compile time, step time (time_fn's median and
quartiles), tokens per second and the loss curve; chapter 09's recorded_profiles.read_fp8 reads them.
Needs torchao (the GPU script installs a wheel whose float8 training runs on its torch). On a CPU
the same code runs at toy size, uncompiled, to test it, not to record.
"""

from __future__ import annotations

import sys
import time

import torch

from course_lib.chapters.ch09.record_questions import gpt_setup, one_step, run_recorder
from course_lib.timing import synchronize, time_fn

__all__: list[str] = []  # a recorder: the chapter reads its file through chapter 09's read_fp8


def markov_batches(
    vocab: int, batch: int, seq: int, n: int, device: torch.device, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic language: each of 1,024 tokens has 4 possible successors. The loss can fall
    from ln(vocab) towards ln(4) = 1.39, so two recipes' loss curves can be compared."""
    g = torch.Generator().manual_seed(seed)
    used = min(vocab, 1024)
    nxt = torch.randint(0, used, (used, 4), generator=g)
    out = []
    for _ in range(n):
        tok = torch.empty(batch, seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, used, (batch,), generator=g)
        choice = torch.randint(0, 4, (batch, seq), generator=g)
        for t in range(seq):
            tok[:, t + 1] = nxt[tok[:, t], choice[:, t]]
        out.append((tok[:, :-1].to(device), tok[:, 1:].to(device)))
    return out


def recipe_row(recipe: str, device: torch.device, data: list, batch: int, seq: int) -> dict:
    """One recipe ("bf16", "tensorwise", "rowwise") trained on `data` in turn: compile (first step),
    time, then 30 more steps (3 off a GPU) for the loss curve."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cuda = device.type == "cuda"
    torch._dynamo.reset()
    model, opt, _, _, _ = gpt_setup(device, batch, seq)
    if recipe != "bf16":
        # the output layer (tied to the embedding) stays in bf16, as torchao's examples leave lm_head
        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda m, fqn: fqn != "lm_head" and isinstance(m, torch.nn.Linear),
        )
    cm = torch.compile(model) if cuda else model  # a CPU run only tests this code
    off = torch.amp.GradScaler(device.type, enabled=False)  # bf16 and float8 need no loss scaling
    losses, it = [], [0]

    def step() -> None:
        x, y = data[it[0] % len(data)]
        it[0] += 1
        losses.append(one_step(cm, opt, off, x, y, "bf16", forward=lambda a, b: cm(a, b)[1])().loss)

    t0 = time.monotonic()
    step()
    synchronize(device)
    compile_s = time.monotonic() - t0
    t = time_fn(step, warmup=2, iters=10 if cuda else 2, device=device)
    for _ in range(30 if cuda else 3):
        step()
    return {
        "recipe": recipe,
        "batch": batch,
        "seq": seq,
        "compile_s": compile_s,
        "ms_per_step": t.median_ms,
        "ms_q1": t.quartiles_ms[0],
        "ms_q3": t.quartiles_ms[1],
        "tokens_per_s": batch * seq / t.median_ms * 1e3,
        "losses": [float(v) for v in torch.stack(losses).cpu()],
    }


def fp8_gpt(device: torch.device, deadline: float = float("inf")) -> dict:
    """The payload: {"torchao" (its version), "rows" (one per recipe), "data"}. A recipe reached after
    `deadline` (time.monotonic) is skipped, once one has been measured."""
    import torchao

    cuda = device.type == "cuda"
    batch, seq = (16, 1024) if cuda else (2, 64)
    data = markov_batches(50304 if cuda else 512, batch, seq, 4, device)
    rows = []
    for recipe in ("bf16", "tensorwise", "rowwise"):
        if time.monotonic() > deadline and rows:
            rows.append({"recipe": recipe, "note": "skipped: the call's deadline"})
            continue
        rows.append(recipe_row(recipe, device, data, batch, seq))
    return {"torchao": torchao.__version__, "rows": rows, "data": "markov_batches: 1,024 tokens, 4 successors"}


def summary(payload: dict) -> str:
    """One line per measured recipe: step time, speed-up over bf16, last loss."""
    rows = [r for r in payload["rows"] if "ms_per_step" in r]
    base = rows[0]["ms_per_step"]
    return "\n".join(
        f"{r['recipe']}: {r['ms_per_step']:.1f} ms/step, x{base / r['ms_per_step']:.3f}, "
        f"last loss {r['losses'][-1]:.3f}"
        for r in rows
    )


def main(argv: list[str] | None = None) -> int:
    return run_recorder("course_lib.chapters.ch11.record_fp8", __doc__, fp8_gpt, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
