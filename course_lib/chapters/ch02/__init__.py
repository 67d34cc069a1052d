"""Chapter 02 (02_autocast.ipynb): the library code its cells call, one module per topic.

- autocast_dispatch.py: What autocast does, seen from the dispatcher: which ops it has kernels for,
  and what reaches the kernels.
- autocast_dtypes.py: Where every dtype ends up in a training step under autocast, and the memory
  that saves.
- autocast_policy.py: What autocast does on the installed torch, found by running it, not by reading
  a list.
- matmul_speed.py: How fast a matmul runs in each precision on this device, next to the datasheet peak.
- saved_tensors.py: What autograd saves for backward, in bytes: the memory autocast shrinks, and the
  copies it adds.
- step_memory.py: A training step's memory, walked through backward and measured: the MLP.

Its exercises are checked by course_lib/tooling/checks/ch02.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch02.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
