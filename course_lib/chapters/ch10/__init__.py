"""Chapter 10 (10_memory.ipynb): the library code its cells call, one module per topic.

- predict.py: The one entry point: a training step described (`Step`) and its memory predicted
  moment by moment (`predict_step`): the peak, the moment it falls at, the bytes by kind.
- memory_model.py: Where a step's memory goes, moment by moment: a tape of the forward pass walked
  forward, recomputed and backward.
- tapes.py: The forward pass of each model of the course (GPT, MLP, SimpleCNN, ResNet-50) as a tape.
- measure.py: Any step predict_step takes, measured by PyTorch's own tracker (MemTracker under
  FakeTensorMode, on a CPU).
- explorer.py: The memory explorer: every option of a GPT step moved, its predicted peak redrawn
  by kind (a widget with a static picture).
- master_weights.py: Pure bf16 weights with fp32 master copies: the fix for w + Δw == w.
- record_memory.py: Records the memory of training steps on a GPU, phase by phase: what
  recorded.py predicts.
- recorded.py: A recorded GPU run's memory, predicted row by row with CUDA's rules.

Its exercises are checked by course_lib/tooling/checks/ch10.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch10.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
