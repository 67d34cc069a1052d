"""Chapter 03 (03_grad_scaler.ipynb): the library code its cells call, one module per topic.

- loss_scale_simulator.py: The loss-scale simulator, an interactive explorer with a static fallback.
- overflow.py: Where a forward pass first overflows: chapter 03's collapsing scale, chapter 09's
  NaN/inf walkthrough.
- scaler.py: Dynamic loss scaling, written out: what torch.amp.GradScaler does to its scale, bit for
  bit.
- underflow.py: Underflow on real gradients: where a model's gradient values land in fp16, with and
  without a loss scale.

Its exercises are checked by course_lib/tooling/checks/ch03.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch03.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
