"""Chapter 11 (11_speed.ipynb): the library code its cells call, one module per topic.

- roofline.py: Predicting an op's time from two measured ceilings and a floor: the roofline, on
  this machine and on a recorded GPU.
- step_profile.py: A whole step, op by op: profiled ops (this CPU's, or a recorded GPU's) costed by
  the roofline's rules; a host-bound step predicted from its kernel count.
- fp8.py: FP8 matmuls by hand: formats, tensorwise and rowwise scales, and what torch._scaled_mm
  computes.
- record_roofline.py: Records a GPU's roofline: its ceilings, Tensor-Core shapes, fp8 matmuls and
  profiled steps.
- record_fp8.py: Records GPT-2 small trained in bf16 against torchao's float8 recipes.
- microscaling.py: Microscaling by hand: MXFP8, MXFP4 and NVFP4 block scales (e8m0, e4m3), packed
  4-bit codes, the floor and round-up rules, bit for bit with torchao's to_mx.

Its exercises are checked by course_lib/tooling/checks/ch11.py; the half of each check that runs
in the task process is course_lib/tooling/probes/ch11.py. Imports: the core, and earlier
chapters only (tests/test_structure.py keeps it so).
"""

__all__: list[str] = []
