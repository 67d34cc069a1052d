"""Chapter 12 (12_sharding.ipynb): the library code its cells call, one module per topic.

- shard_memory.py: From DDP to ZeRO to FSDP2, in bytes: what each rank holds, predicted by
  arithmetic (padded shards, optimizer state, gradients, all-gather and reduce-scatter buffers),
  beside the Playbook's ZeRO-1/2/3 formulas.
- memory_worker.py: One rank of chapter 12's memory runs: FSDP2's bytes per rank at N = 1, 2, 4,
  measured by FSDPMemTracker, with the peak's moment.
- fake_world.py: N ranks you do not have, predicted in one process (a fake process group and fake
  tensors, GPT-2 small up to N = 1,024), and the real runs they are checked against.
- precision.py: MixedPrecisionPolicy's dtypes against autocast, the traps measured, TP and 2-D meshes.
- precision_worker.py: one rank of chapter 12's precision runs.
- two_nodes.py: two torchrun "nodes" on one machine, really launched: the rank program and its launch.

Imports: the core, and earlier chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
