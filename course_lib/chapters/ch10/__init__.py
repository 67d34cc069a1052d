"""Chapter 10 (10_memory.ipynb): the library code its cells call, one module per topic.

- memory_model.py: Where a training step's memory goes, predicted tensor by tensor.
- explorer.py: The memory explorer: batch, sequence, precision and checkpointing moved, GPT-2
  small's predicted step redrawn by kind (a widget with a static picture).
- measure.py: A training step's memory measured by PyTorch's own tracker (MemTracker under
  FakeTensorMode, on a CPU), for chapter 10's predictions.
- master_weights.py: Pure bf16 weights with fp32 master copies: the fix for w + Δw == w.
- recorded.py: A recorded GPU run's memory, predicted row by row with CUDA's rules.

Its exercises are checked by course_lib/tooling/checks/ch10.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch10.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
