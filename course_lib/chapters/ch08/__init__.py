"""Chapter 08 (08_distributed.ipynb): the library code its cells call, one module per topic.

- ddp_launch.py: torchrun started from a notebook or a shell, and every process it started stopped
  again.
- ddp_worker.py: One rank of chapter 08's DDP run: the program torchrun starts in every process.
- distributed.py: DDP's promises checked against one process, the sampler's split, the training
  state that motivates FSDP2, DataParallel against DDP, FSDP2's sharded gradient.

Its exercises are checked by course_lib/tooling/checks/ch08.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch08.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
